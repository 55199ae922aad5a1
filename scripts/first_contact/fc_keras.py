"""First contact: Keras 3's MultiHeadAttention and GroupedQueryAttention (torch backend) through tfmoe's attn-check.

impl=fc_keras:MHA (return_attention_scores=True: Keras's explicit softmax path, weights come back) and
impl=fc_keras:GQA (no weights: Keras's dot_product_attention path). Keras's conventions: kernels are EinsumDense
(D, H, Dh) for q/k/v and (H, Dh, D) for the output; value_mask (B, S) True = a real key; use_causal_mask=True;
a masked score is set to -1e9 (a query that sees no key averages v). The Bug* classes plant a bug inside Keras's
own code path.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import torch  # noqa: E402
from keras.src.layers.attention import grouped_query_attention as keras_gqa  # noqa: E402
from keras.src.layers.attention import multi_head_attention as keras_mha  # noqa: E402

from tfmoe.adapters import AttentionAdapter, Projections  # noqa: E402

_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float64: "float64"}


def _seed_keras(seed: int | None) -> None:
    """Keras draws initial weights from its own RNG. tfmoe calls build with seed=None (weights from the run's torch
    RNG, already seeded), which keras.utils.set_random_seed refuses: take Keras's seed from torch's RNG then."""
    keras.utils.set_random_seed(int(torch.randint(0, 2**31 - 1, ()).item()) if seed is None else seed)


class _KerasAdapter(AttentionAdapter):
    takes_dropout = False

    def plant(self) -> None:
        """Where a Bug* subclass changes Keras's own code."""

    def parameters(self, module):
        return {v.path: v.value for v in module.weights}  # the torch Parameters behind Keras's variables

    def projections(self, params, n_heads, n_kv_heads):
        p = {k.split("/", 1)[1]: v for k, v in params.items()}  # drop the layer's own name

        def linear(kernel):  # (D, H, Dh) -> nn.Linear's (H*Dh, D)
            return kernel.reshape(kernel.shape[0], -1).T

        out = p["attention_output/kernel"]  # (H, Dh, D)
        return Projections(linear(p["query/kernel"]), linear(p["key/kernel"]), linear(p["value/kernel"]),
                           out.reshape(-1, out.shape[-1]).T, n_heads, n_kv_heads,
                           b_q=p["query/bias"].reshape(-1), b_k=p["key/bias"].reshape(-1),
                           b_v=p["value/bias"].reshape(-1), b_o=p["attention_output/bias"])


class MHA(_KerasAdapter):
    returns_weights = True
    supports_gqa = False

    def build(self, d_model, n_heads, *, n_kv_heads, causal, dropout, seed, dtype, device):
        self.plant()
        _seed_keras(seed)
        layer = keras.layers.MultiHeadAttention(num_heads=n_heads, key_dim=d_model // n_heads, dtype=_DTYPES[dtype],
                                                name="attention")  # one name: two builds share state_dict keys
        layer.build((None, None, d_model), (None, None, d_model))
        return layer

    def forward(self, module, x, padding_mask, *, causal, cache=None):
        out, w = module(x, x, value_mask=padding_mask, use_causal_mask=causal, return_attention_scores=True)
        return out, w


class GQA(_KerasAdapter):
    returns_weights = False
    supports_gqa = True

    def build(self, d_model, n_heads, *, n_kv_heads, causal, dropout, seed, dtype, device):
        self.plant()
        _seed_keras(seed)
        layer = keras.layers.GroupQueryAttention(head_dim=d_model // n_heads, num_query_heads=n_heads,
                                                 num_key_value_heads=n_kv_heads, dtype=_DTYPES[dtype],
                                                 name="attention")
        layer.build((None, None, d_model), (None, None, d_model))
        return layer

    def forward(self, module, x, padding_mask, *, causal, cache=None):
        return module(x, x, value_mask=padding_mask, use_causal_mask=causal), None


class BugMHAScale(MHA):
    """Keras's MultiHeadAttention scales by 1/sqrt(d_model) instead of 1/sqrt(key_dim)."""

    def plant(self) -> None:
        orig = keras_mha.MultiHeadAttention.__init__

        def __init__(self, num_heads, key_dim, *a, **kw):
            orig(self, num_heads, key_dim, *a, **kw)
            self._inverse_sqrt_key_dim = (num_heads * key_dim) ** -0.5

        keras_mha.MultiHeadAttention.__init__ = __init__


class _TiledOps:
    """keras.ops as grouped_query_attention sees it, except that repeat tiles the kv heads (h % Hkv)."""

    def __getattr__(self, name):
        return getattr(keras.ops, name)

    @staticmethod
    def repeat(x, repeats, axis=None):
        reps = [1] * len(x.shape)
        reps[axis] = repeats
        return keras.ops.tile(x, reps)


class BugGQATiled(GQA):
    """GroupedQueryAttention maps query head h to kv head h % Hkv (tile) instead of h // group (repeat)."""

    def plant(self) -> None:
        keras_gqa.ops = _TiledOps()


class BugGQACausal(GQA):
    """GroupedQueryAttention's causal mask lets each query see the next key too."""

    def plant(self) -> None:
        def _compute_causal_mask(self, query, value=None):
            T = keras.ops.shape(query)[1]
            S = T if value is None else keras.ops.shape(value)[1]
            ones = keras.ops.ones((1, T, S), dtype="int32")
            return keras.ops.greater_equal(keras.ops.cumsum(ones, axis=-2) + 1, keras.ops.cumsum(ones, axis=-1))

        keras_gqa.GroupedQueryAttention._compute_causal_mask = _compute_causal_mask


class MHAFirstTry(MHA):
    """The first adapter written from the docs' example: seeds Keras with build's seed as given (None in a run)."""

    def build(self, d_model, n_heads, *, n_kv_heads, causal, dropout, seed, dtype, device):
        keras.utils.set_random_seed(seed)
        return super().build(d_model, n_heads, n_kv_heads=n_kv_heads, causal=causal, dropout=dropout, seed=0,
                             dtype=dtype, device=device)


class GQAFirstTry(GQA):
    """Before naming the layer: Keras names each instance anew (grouped_query_attention_1, ...), and so the keys of
    its torch state_dict."""

    def build(self, d_model, n_heads, *, n_kv_heads, causal, dropout, seed, dtype, device):
        _seed_keras(seed)
        layer = keras.layers.GroupQueryAttention(head_dim=d_model // n_heads, num_query_heads=n_heads,
                                                 num_key_value_heads=n_kv_heads, dtype=_DTYPES[dtype])
        layer.build((None, None, d_model), (None, None, d_model))
        return layer
