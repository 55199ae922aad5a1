"""First contact: five public libraries tfmoe has never used, plugged in as a new user would (issue 28, item 6).

Runs every case of ``CASES`` through the CLI (``tfmoe attn-check`` / ``tfmoe route-sim``) from a scratch directory,
with ``scripts/first_contact`` on PYTHONPATH so that ``impl=fc_<lib>:Class`` / ``kernel=fc_<lib>:fn`` import, and
prints one row per case: library, version, case, expected verdict, exit code, status, failed / not-applicable
checks, whether it is a false alarm (a correct layer failed, or a refusal that crashed) or a missed bug, and the
cause recorded for that outcome in ``CAUSES`` (measured before any fix of issue 28; an outcome that differs from
the one analysed is marked ``new``). ``--markdown FILE`` writes the table, ``--json FILE`` the raw rows.

Needs the venv built by ``scripts/first-contact.sh`` (the libraries are not in the lock); not run by CI.

    bash scripts/first-contact.sh                          # build /work/venvs/fc-style venv, run all, print
    VENV/bin/python scripts/first_contact.py --only keras  # a subset (substring of the case id)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
ADAPTERS = HERE / "first_contact"


@dataclass(frozen=True)
class Case:
    id: str
    library: str  # the distribution name, for its version
    kind: str  # correct | bug | refusal
    args: tuple[str, ...]  # after `tfmoe`
    note: str = ""

    @property
    def expected(self) -> str:
        return {"correct": "passes (exit 0)", "bug": "caught (exit 1)", "refusal": "refused (exit 2)",
                "adapter-error": "the adapter's error, not a crash (exit 1 or 2)"}[self.kind]

    @property
    def command(self) -> str:
        return "tfmoe " + " ".join(self.args)


def _attn(*a: str) -> tuple[str, ...]:
    return ("attn-check", *a)


def _route(*a: str) -> tuple[str, ...]:
    return ("route-sim", *a, "steps=0")


FM_NAN = "fully_masked_policy=nan"  # docs: declare the policy when a library gives NaN for a query seeing no key
MEA = ("causal_align=top_left", "kernel_checks.fully_masked_expect=uniform")  # what the wrapper's docstring says

CASES: tuple[Case, ...] = (
    # labml-nn: sequence-first MHA with a [Tq, Tk, B] mask; Switch-Transformer top-1 MoE
    Case("labml.mha", "labml-nn", "correct", _attn("impl=fc_labml:MHA", FM_NAN)),
    Case("labml.mha.bf16", "labml-nn", "correct", _attn("impl=fc_labml:MHA", FM_NAN, "--dtype", "bf16")),
    Case("labml.mha.gqa-refused", "labml-nn", "refusal", _attn("impl=fc_labml:MHA", FM_NAN, "n_kv_heads=1"),
         "the adapter declares supports_gqa = False"),
    Case("labml.mha.bug-mask-transposed", "labml-nn", "bug", _attn("impl=fc_labml:BugMaskTransposed", FM_NAN)),
    Case("labml.mha.bug-scale", "labml-nn", "bug", _attn("impl=fc_labml:BugScale", FM_NAN)),
    Case("labml.switch", "labml-nn", "correct", _route("impl=fc_labml:Switch", "top_k=1")),
    Case("labml.switch.top2-refused", "labml-nn", "refusal", _route("impl=fc_labml:Switch"),
         "the adapter's build raises ValueError for top_k != 1 (route-sim's default top_k is 2)"),
    Case("labml.switch.bug-softmax-tokens", "labml-nn", "bug", _route("impl=fc_labml:BugSwitchSoftmaxTokens",
                                                                       "top_k=1")),
    Case("labml.switch.bug-dropped-expert", "labml-nn", "bug", _route("impl=fc_labml:BugSwitchDroppedExpert",
                                                                       "top_k=1")),
    # torchscale: fairseq-style MHA (key_padding_mask True = padded, additive attn_mask, weights (H,B,T,S))
    Case("torchscale.mha", "torchscale", "correct", _attn("impl=fc_torchscale:MHA", FM_NAN)),
    Case("torchscale.mha.noncausal", "torchscale", "correct", _attn("impl=fc_torchscale:MHA", FM_NAN,
                                                                      "causal=false")),
    Case("torchscale.mha.bf16", "torchscale", "correct", _attn("impl=fc_torchscale:MHA", FM_NAN, "--dtype", "bf16")),
    Case("torchscale.mha.bug-padding-ignored", "torchscale", "bug", _attn("impl=fc_torchscale:BugPaddingIgnored",
                                                                            FM_NAN)),
    Case("torchscale.mha.bug-scale", "torchscale", "bug", _attn("impl=fc_torchscale:BugScale", FM_NAN)),
    # Keras 3 (torch backend): MultiHeadAttention (explicit softmax path) and GroupQueryAttention (SDPA path)
    Case("keras.mha", "keras", "correct", _attn("impl=fc_keras:MHA")),
    Case("keras.gqa", "keras", "correct", _attn("impl=fc_keras:GQA", "d_model=16", "n_heads=4", "n_kv_heads=2")),
    Case("keras.gqa.mqa-bf16", "keras", "correct", _attn("impl=fc_keras:GQA", "d_model=16", "n_heads=4",
                                                         "n_kv_heads=1", "--dtype", "bf16")),
    Case("keras.mha.first-try", "keras", "adapter-error", _attn("impl=fc_keras:MHAFirstTry"),
         "the docs' `with seeded(seed)` suggests an int; build gets seed=None and Keras's set_random_seed raises"),
    Case("keras.gqa.unnamed", "keras", "correct", _attn("impl=fc_keras:GQAFirstTry", "d_model=16", "n_heads=4",
                                                        "n_kv_heads=2"),
         "the same layer, left to name itself: each build gets new state_dict keys"),
    Case("keras.mha.bug-scale", "keras", "bug", _attn("impl=fc_keras:BugMHAScale")),
    Case("keras.gqa.bug-heads-tiled", "keras", "bug", _attn("impl=fc_keras:BugGQATiled", "d_model=16", "n_heads=4",
                                                            "n_kv_heads=2")),
    Case("keras.gqa.bug-causal-off-by-one", "keras", "bug", _attn("impl=fc_keras:BugGQACausal", "d_model=16",
                                                                  "n_heads=4", "n_kv_heads=2")),
    # memory-efficient-attention-pytorch: a chunked kernel wrapped into SDPA's signature
    Case("mea.kernel", "memory-efficient-attention-pytorch", "correct", _attn("kernel=fc_mea:kernel", *MEA)),
    Case("mea.kernel.bf16", "memory-efficient-attention-pytorch", "correct", _attn("kernel=fc_mea:kernel", *MEA,
                                                                                   "--dtype", "bf16")),
    Case("mea.kernel.bug-causal", "memory-efficient-attention-pytorch", "bug", _attn("kernel=fc_mea:kernel_bug_causal",
                                                                                     *MEA)),
    Case("mea.kernel.bug-rescale", "memory-efficient-attention-pytorch", "bug",
         _attn("kernel=fc_mea:kernel_bug_rescale", *MEA)),
    # mistral-inference: MoeLayer (Mixtral's block: softmax over the top-k logits)
    Case("mistral.moe", "mistral-inference", "correct", _route("impl=fc_mistral:Adapter")),
    Case("mistral.moe.bug-softmax-tokens", "mistral-inference", "bug", _route("impl=fc_mistral:BugSoftmaxTokens")),
    Case("mistral.moe.bug-first-weight-only", "mistral-inference", "bug",
         _route("impl=fc_mistral:BugFirstWeightOnly")),
)

# The cause of each outcome that is not the expected one, as analysed on the code before any fix of issue 28
# (experiments/zoo.md, "First contact ... before any fix"): case id -> (exit code analysed, cause).
NAN_GATE = ("C1 NaN in a don't-care padded query row is read as a random eval-mode forward: every check but "
            "shapes/chunked is 'not judged', none fails, exit 0 (F-196)")
GQA_UNREAD = "C2 supports_gqa = False is never read: tfmoe's own shapes check crashes on the layer's q/k/v (exit 3)"
BUILD_RAISES = ("C3 an exception in the user's adapter build() ends the run 'crashed' (exit 3); no documented way "
                "for an adapter to refuse a setting (exit 2)")
STATE_KEYS = ("C4 the battery copies weights between two builds with load_state_dict; a layer whose state_dict keys "
              "change per instance crashes, blamed on tfmoe (exit 3); the contract is undocumented")
FUNCTIONAL_GRADS = ("C5 grad_match takes gradients through torch.func.functional_call with parameters()' names: "
                    "weights held outside nn.Module attributes (Keras variables) are not swapped, get no gradient "
                    "-> inf (limit 0), though .backward() gives them the right one (F-197)")
AUTOGRAD_GRAD = ("C6 kernel_backward takes gradients with torch.autograd.grad, which reentrant torch.utils.checkpoint "
                 "refuses: a right backward (checked with .backward() against SDPA) fails as 'raised' (F-198)")
CAUSES: dict[str, tuple[int, str]] = {
    "labml.mha.bug-mask-transposed": (0, NAN_GATE),
    "labml.mha.gqa-refused": (3, GQA_UNREAD),
    "labml.switch.top2-refused": (3, BUILD_RAISES),
    "keras.mha.first-try": (3, BUILD_RAISES),
    "keras.gqa.unnamed": (3, STATE_KEYS),
    "keras.mha": (1, FUNCTIONAL_GRADS),
    "keras.gqa": (1, FUNCTIONAL_GRADS),
    "keras.gqa.mqa-bf16": (1, FUNCTIONAL_GRADS),
    "mea.kernel": (1, AUTOGRAD_GRAD),
    "mea.kernel.bf16": (1, AUTOGRAD_GRAD),
}


@dataclass
class Row:
    case: str
    library: str
    version: str
    kind: str
    expected: str
    command: str
    exit_code: int
    status: str
    failed: list[str] = field(default_factory=list)
    not_applicable: list[str] = field(default_factory=list)
    verdict: str = ""  # ok | false alarm | missed bug | crashed on a bug
    cause: str = ""
    first_error: str = ""
    run_dir: str = ""
    wall_s: float = 0.0


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _read_run(runs: Path) -> tuple[str, list[str], list[str], str, bool]:
    """status, failed checks, not-applicable checks (rows with no verdict, or named in the notes), run dir, and
    whether some failed check measured a value (its detail does not start with "raised")."""
    import pandas as pd

    dirs = sorted(p.parent for p in runs.rglob("run.parquet"))
    if not dirs:
        return "no run", [], [], "", False
    d = dirs[-1]
    run = pd.read_parquet(d / "run.parquet").iloc[0]
    failed, na, measured = [], [], False
    if (d / "checks.parquet").exists():
        checks = pd.read_parquet(d / "checks.parquet")
        for _, c in checks.iterrows():
            if c["passed"] is None or (isinstance(c["passed"], float) and c["passed"] != c["passed"]):
                na.append(str(c["check"]))
            elif not bool(c["passed"]):
                failed.append(str(c["check"]))
                measured = measured or not str(c["detail"]).startswith("raised")
    notes = run.get("notes")
    for line in (json.loads(notes) if isinstance(notes, str) and notes.startswith("[") else
                 ([] if notes is None else [str(notes)])):
        if "not applicable" in str(line):
            na.append(str(line)[:160])
    return str(run["status"]), failed, na, str(d), measured


def verdict(kind: str, code: int, measured: bool) -> str:
    """ok | false alarm | missed bug | bug not judged (...): a bug counts as caught only by a failed check that
    measured a value (not one whose detail is the layer's exception); an adapter's own error must not be a crash."""
    want = {"correct": 0, "bug": 1, "refusal": 2, "adapter-error": code if code in (1, 2) else 1}[kind]
    if code == want and (kind != "bug" or measured):
        return "ok"
    if kind == "bug" and code == 1:
        return "bug not judged (every failed check raised)"
    if kind == "bug":
        return "missed bug" if code == 0 else f"bug not judged (exit {code})"
    return "false alarm"


def run_case(case: Case, tfmoe: str, scratch: Path, timeout: int) -> Row:
    work = scratch / case.id
    work.mkdir(parents=True, exist_ok=True)
    # the adapters first; a PYTHONPATH already set (e.g. a checkout's src, to measure it with another venv) after
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ADAPTERS), *filter(None, [os.environ.get("PYTHONPATH")])]),
               KERAS_BACKEND="torch")
    t0 = time.perf_counter()
    try:
        p = subprocess.run([tfmoe, *case.args, f"run_root={work / 'runs'}"], cwd=work, env=env, capture_output=True,
                           text=True, timeout=timeout)
        code, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        code, out, err = 124, str(e.stdout or ""), f"timed out after {timeout} s"
    wall = time.perf_counter() - t0
    (work / "stdout.txt").write_text(out)
    (work / "stderr.txt").write_text(err)
    status, failed, na, run_dir, measured = _read_run(work / "runs")
    row = Row(case.id, case.library, _version(case.library), case.kind, case.expected, case.command, code, status,
              failed, na, run_dir=run_dir, wall_s=round(wall, 1))
    row.first_error = next((ln.strip() for ln in err.splitlines() if ln.strip() and not ln.startswith("WARNING")),
                           "")[:300]
    row.verdict = verdict(case.kind, code, measured)
    if row.verdict != "ok":
        analysed = CAUSES.get(case.id)
        row.cause = analysed[1] if analysed and analysed[0] == code else "new: not analysed (see stderr.txt)"
    return row


def markdown(rows: list[Row]) -> str:
    head = ("| library | version | case | expected | exit | status | failed / n/a checks | false alarm | cause |\n"
            "|---|---|---|---|---|---|---|---|---|\n")
    body = []
    for r in rows:
        checks = ", ".join(r.failed) or "—"
        na_checks = [n for n in r.not_applicable if " " not in n]
        if na_checks:
            checks += f"; n/a: {', '.join(na_checks)}"
        fa = "yes" if r.verdict == "false alarm" else ("missed" if r.verdict == "missed bug" else "no")
        body.append(f"| {r.library} | {r.version} | `{r.command.removeprefix('tfmoe ')}` | {r.expected} | "
                    f"{r.exit_code} | {r.status} | {checks} | {fa} | {r.cause or '—'} |")
    return head + "\n".join(body) + "\n"


def summary(rows: list[Row]) -> str:
    correct = [r for r in rows if r.kind != "bug"]
    bugs = [r for r in rows if r.kind == "bug"]
    fa = [r for r in correct if r.verdict != "ok"]
    caught = [r for r in bugs if r.verdict == "ok"]
    missed = [r for r in bugs if r.verdict == "missed bug"]
    return (f"{len(rows)} cases: {len(correct) - len(fa)} of {len(correct)} correct layers / refusals as expected, "
            f"{len(fa)} false alarm(s) ({len([r for r in fa if r.kind == 'correct'])} correct layers failed or crashed); {len(caught)} of {len(bugs)} planted bugs caught, {len(missed)} missed, "
            f"{len(bugs) - len(caught) - len(missed)} not judged")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="run the cases whose id contains this")
    ap.add_argument("--markdown", type=Path, help="write the table (and the summary line) here")
    ap.add_argument("--json", type=Path, help="write the rows as JSON here")
    ap.add_argument("--scratch", type=Path, help="where the runs go (default: a new temporary directory)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per case")
    ap.add_argument("--from-json", type=Path, nargs="+", help="no runs: rebuild the table from saved --json files "
                    "(later files replace earlier rows of the same case), in CASES order")
    a = ap.parse_args(argv)
    if a.from_json:
        saved = {r["case"]: Row(**r) for f in a.from_json for r in json.loads(f.read_text())}
        rows = [saved[c.id] for c in CASES if c.id in saved]
        for r in rows:  # re-read the causes: the analysis may be newer than the runs
            if r.verdict != "ok":
                analysed = CAUSES.get(r.case)
                r.cause = analysed[1] if analysed and analysed[0] == r.exit_code else "new: not analysed"
        table = markdown(rows)
        print(table + "\n" + summary(rows))
        if a.markdown:
            a.markdown.write_text(table + "\n" + summary(rows) + "\n")
        return 0
    tfmoe = str(Path(sys.executable).with_name("tfmoe"))
    scratch = a.scratch or Path(tempfile.mkdtemp(prefix="first-contact-"))
    rows = []
    for case in CASES:
        if a.only and a.only not in case.id:
            continue
        row = run_case(case, tfmoe, scratch, a.timeout)
        rows.append(row)
        print(f"{row.case:40s} exit {row.exit_code} {row.status:8s} {row.verdict:12s} {row.wall_s:7.1f}s "
              f"failed={','.join(row.failed) or '-'} {row.first_error[:120] if row.exit_code not in (0, 1) else ''}",
              flush=True)
    table = markdown(rows)
    print()
    print(table)
    print(summary(rows))
    print(f"runs and each case's stdout/stderr: {scratch}")
    if a.markdown:
        a.markdown.write_text(table + "\n" + summary(rows) + "\n")
    if a.json:
        a.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
