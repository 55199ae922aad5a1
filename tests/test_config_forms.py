"""Every config form documented in conf/*.yaml is accepted by the CLI's own validation (launch.validate_overrides),
the path `tfmoe <experiment> key=value` takes; wrong types are still refused with exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tfmoe.api.testing import run_cli
from tfmoe.contract.errors import BadInput
from tfmoe.contract.registry import EXPERIMENTS
from tfmoe.harness.launching.launch import CONFIG_FORMS, config_dir, validate_overrides

# Per experiment, each key with the forms its config file documents in its comments (besides the default),
# as one sweep override per key: the CLI's validation types every swept value (one Hydra compose per experiment).
DOCUMENTED_FORMS = {
    "shift-labels": [  # base.yaml's keys (shared by every experiment) and shift_labels.yaml's
        "device=cpu,auto,cuda,cuda:1,mps", "dtype=fp32,fp16,bf16,fp64", "threads=null,2", "seed=3",
        "run_root=/tmp/tfmoe-runs", "tensor_max_numel=10",
        "sequences=[[1,3,2],[1,2]],[[BOS,EOS],[BOS,PAD,EOS]]", "pad_side=left,right", "ignore_index=-1",
        "impl=null,hf:gpt2,mypackage.module:MyLM", "lacks=[],[loss]", "lm.tol_eps=64",
    ],
    "attn-check": [
        "checks=all,[masks,sdpa],masks,[masks,sdpa,fully_masked,gradients,kv_cache,chunked,invariances,dropout]",
        "lengths=null,[4,3]", "head_counts=null,[1,2]", "dropout=0,0.2", "mode=full,chunked",
        "impl=mypackage.module:MyAttention,torch:mha,hf:llama", "chunked.impl=mypackage.module:my_function",
        "chunked.probe_T=32768", "fully_masked_policy=finite,nan,any", "padded_query_policy=any,attend,zeros",
        "kernel_checks.fully_masked_expect=zeros,nan,any,[zeros,nan,uniform],{bool:zeros,additive:nan,causal:uniform}",
        "kernel_checks.dropout_p=0,0.2", "kernel_checks.dropout_shape=[48,32,32]",
        "cases.masks=[none,causal,bool_random,per_head_additive]",
    ],
    "arch": ["rope=false", "visibility_tol_eps=8,16.5", "equivariance_tol_eps=32.5", "min_position_effect=1",
             "impl=null,hf:llama,mypackage.module:MyLM", "lacks=[],[kv_cache,loss]", "lm.lengths=[4,9]",
             "lm.tol_eps=32,64.5"],
    "block-stats": [
        "variants=[pre,post],[pre,pre_rms],[pre,pre_swiglu],[pre_rms_swiglu]", "init=torch,xavier",
        "lowp_dtypes=[],[fp16]", "eps=1e-5,0.5", "lowp_stress_scale=512,100.5", "n_layers=2,24",
    ],
    "complexity": ["T=128,512,2048", "D=256,1024", "groups=[[512,256]]", "d_ff=1024,null", "threads=null,2"],
    "decode": [
        "corpus_path=/tmp/corpus.txt,null", "prompt_ids=[19,7,4],null", "top_k=null,1", "top_p=null,1,0.5",
        "temperature=0,1", "train_steps=0", "threads=null,2", "logit_tol_eps=64,32.5",
        "impl=null,hf:qwen2_moe,mypackage.module:MyLM", "lacks=[],[kv_cache]", "lm.use_cache=false",
        "lm.low_precision=[],[bf16]", "lm.steps=24",
    ],
    "route-sim": [
        "capacity_factor=null,2,1.25", "score_func=sigmoid,softmax", "dispatch=loop,sorted",
        "strategies=[none,aux_free],[aux_loss]", "steps=0", "top_k=1",
        "impl=null,hf:mixtral,hf:deepseek_v3,mypackage.module:ToyMoE", "layer.norm_topk_prob=false",
        "layer.routed_scaling_factor=1", "layer.bias_scale=0", "lacks=[],[fp16,bf16]",
        "layer.expert_dtype=null,bf16", "layer.router_dtype=null,fp32",
    ],
    "tokenize": [
        "input=/tmp/text.txt,null", "tokenizers=[cl100k_base,bytes],[file:/tmp/tokenizer.json]", "extras=[]",
        "train.categories=[en,code],null", "premium.numerator=en", "fertility_categories=[en,zh]",
    ],
}


@pytest.mark.parametrize("experiment", sorted(DOCUMENTED_FORMS))
def test_every_documented_form_passes_the_cli_validation(experiment: str) -> None:
    assert validate_overrides(EXPERIMENTS[experiment], DOCUMENTED_FORMS[experiment]) is not None


def test_every_experiment_has_its_documented_forms_listed() -> None:
    assert set(DOCUMENTED_FORMS) == set(EXPERIMENTS)


@pytest.mark.parametrize(("experiment", "override", "needle"), [
    ("attn-check", "checks=true", "expected a string or a list"),
    ("attn-check", "checks={a:1}", "expected a string or a list"),
    ("block-stats", "variants=3", "expected a list"),
    ("decode", "top_k=abc", "expected an integer"),
])
def test_wrong_types_are_still_refused(experiment: str, override: str, needle: str) -> None:
    with pytest.raises(BadInput, match=needle):
        validate_overrides(EXPERIMENTS[experiment], [override])


def test_the_forms_table_names_real_keys() -> None:
    """Each CONFIG_FORMS entry names a key of that config whose default is one of its forms."""
    for (config, key), forms in CONFIG_FORMS.items():
        cfg = yaml.safe_load((Path(config_dir()) / f"{config}.yaml").read_text())
        for part in key.split(".")[:-1]:  # a dotted key: kernel_checks.fully_masked_expect
            cfg = cfg[part]
        leaf = key.split(".")[-1]
        assert leaf in cfg, (config, key)
        assert isinstance(cfg[leaf], forms), (config, key, cfg[leaf])


def test_documented_list_form_of_checks_runs_through_the_cli(tmp_path: Path) -> None:
    """Regression (issue 11 item 4): `tfmoe attn-check checks=[masks,sdpa]` exited 2."""
    r = run_cli(["attn-check", "checks=[masks,sdpa]", "mode=full"], tmp_path)
    assert r.exit_code == 0, r.stderr + r.stdout
    import pandas as pd

    checks = pd.read_parquet(r.run_dir / "checks.parquet")["check"].tolist()
    assert any("sdpa" in c for c in checks) and not any("gradcheck" in c for c in checks)
