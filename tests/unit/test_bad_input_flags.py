"""Bad flags of every subcommand through the real command line, in this process: numbers that
are zero, negative, NaN, infinite, absurd or not numbers; unknown choices; flags that contradict
each other; missing or unknown models, clusters and files; outputs that cannot be written (a
folder, a path under a file), refused before any work. Flags argparse refuses end with its usage
and one error line; the others with one ``meshmorph: error:`` line; all with exit code 2, no
traceback and no process started."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.bad_input import arg_refused, forbid_processes, refused, write
from tests.helpers.jobs import EXAMPLES, gpt_tiny_job

PLANS = EXAMPLES / "plans"
PLAN = ["plan", "--model", "gpt3-125m", "--cluster", "h100:1x8", "--global-batch", "8"]
ESTIMATE = ["estimate", "--model", "gpt3-125m", "--cluster", "h100:1x8", "--tp", "1", "--pp", "1",
            "--dp", "8"]
RESHAPE = ["reshape", "--from", str(PLANS / "reshape-tp2-pp2.json"), "--to",
           str(PLANS / "reshape-zero3-dp4.json")]
SIMULATE = ["simulate", "--model", "gpt3-125m", "--tokens", "1e9", "--cluster", "h100:1x8", "--spot"]
ADVISE = ["advise", "--model", "gpt3-125m", "--tokens", "1e9"]
TIMELINE = ["timeline", "--schedule", "1f1b", "--pp", "4", "--microbatches", "8"]
JOB = gpt_tiny_job(steps=4)


@pytest.fixture(autouse=True)
def _no_process_may_start(monkeypatch: pytest.MonkeyPatch) -> None:
    forbid_processes(monkeypatch)


def _with(base: list[str], flag: str, value: str) -> list[str]:
    """``base`` with ``flag`` set to ``value`` (replaced where ``base`` sets it)."""
    if flag in base:
        index = base.index(flag)
        return [*base[:index + 1], value, *base[index + 2:]]
    return [*base, flag, value]


# --- flags argparse refuses --------------------------------------------------------------------
ARG_CASES: list[tuple[str, list[str], tuple[str, ...]]] = [
    ("plan --top 0", _with(PLAN, "--top", "0"), ("--top: must be at least 1, got 0",)),
    ("plan --seq-len 0", _with(PLAN, "--seq-len", "0"), ("--seq-len: must be at least 1, got 0",)),
    ("plan --seq-len absurd", _with(PLAN, "--seq-len", "10000000000"),
     ("--seq-len: 10000000000 is above the limit of 16,777,216 tokens",)),
    ("plan --global-batch 0", _with(PLAN, "--global-batch", "0"),
     ("--global-batch: must be at least 1, got 0",)),
    ("plan --global-batch negative", _with(PLAN, "--global-batch", "-8"),
     ("--global-batch: must be at least 1, got -8",)),
    ("plan --max-micro-batch 0", _with(PLAN, "--max-micro-batch", "0"),
     ("--max-micro-batch: must be at least 1, got 0",)),
    ("plan --max-cp 0", _with(PLAN, "--max-cp", "0"), ("--max-cp: must be at least 1, got 0",)),
    ("plan --max-nodes a word", _with(PLAN, "--max-nodes", "many"), ("--max-nodes", "'many'")),
    ("plan --tolerance a word", _with(PLAN, "--tolerance", "tight"), ("--tolerance", "'tight'")),
    ("plan --dtype fp4", _with(PLAN, "--dtype", "fp4"), ("--dtype: invalid choice: 'fp4'",)),
    ("plan --layerwise-schedules unknown", _with(PLAN, "--layerwise-schedules", "some"),
     ("--layerwise-schedules: invalid choice: 'some'",)),
    ("plan --weight-prediction unknown", _with(PLAN, "--weight-prediction", "guess"),
     ("--weight-prediction: invalid choice: 'guess'",)),
    ("plan without --model", ["plan", "--cluster", "h100:1x8", "--global-batch", "8"],
     ("the following arguments are required: --model",)),
    ("plan unknown flag", [*PLAN, "--fast"], ("unrecognized arguments: --fast",)),
    ("estimate --tp 0", _with(ESTIMATE, "--tp", "0"), ("--tp: must be at least 1, got 0",)),
    ("estimate --pp 0", _with(ESTIMATE, "--pp", "0"), ("--pp: must be at least 1, got 0",)),
    ("estimate --dp negative", _with(ESTIMATE, "--dp", "-8"), ("--dp: must be at least 1, got -8",)),
    ("estimate --dp fractional", _with(ESTIMATE, "--dp", "2.5"),
     ("--dp: must be a whole number, got '2.5'",)),
    ("estimate --cp 0", _with(ESTIMATE, "--cp", "0"), ("--cp: must be at least 1, got 0",)),
    ("estimate --micro-batch 0", _with(ESTIMATE, "--micro-batch", "0"),
     ("--micro-batch: must be at least 1, got 0",)),
    ("estimate --vpp 0", _with(ESTIMATE, "--vpp", "0"), ("--vpp: must be at least 1, got 0",)),
    ("estimate --seq-len 0", _with(ESTIMATE, "--seq-len", "0"), ("--seq-len: must be at least 1",)),
    ("estimate --seq-len absurd", _with(ESTIMATE, "--seq-len", "100000000000"),
     ("is above the limit of 16,777,216 tokens (2**24)",)),
    ("estimate --global-batch absurd", _with(ESTIMATE, "--global-batch", "99999999999999"),
     ("is above the limit of 16,777,216 sequences (2**24)",)),
    ("estimate --zero 4", _with(ESTIMATE, "--zero", "4"), ("--zero: invalid choice: 4",)),
    ("estimate --schedule unknown", _with(ESTIMATE, "--schedule", "fast"),
     ("--schedule: invalid choice: 'fast'",)),
    ("estimate --recompute unknown", _with(ESTIMATE, "--recompute", "some"),
     ("--recompute: invalid choice: 'some'",)),
    ("estimate without --cluster", ["estimate", "--model", "gpt3-125m"],
     ("the following arguments are required: --cluster",)),
    ("run --trace negative", ["run", "--config", "job.toml", "--trace", "-1"],
     ("--trace: must be 0 or more, got -1",)),
    ("run --nproc a word", ["run", "--config", "job.toml", "--nproc", "two"],
     ("--nproc: invalid int value: 'two'",)),
    ("run --node-rank a word", ["run", "--config", "job.toml", "--node-rank", "first"],
     ("--node-rank: invalid int value: 'first'",)),
    ("run without --config", ["run"], ("the following arguments are required: --config",)),
    ("reshape --survivors words", _with(RESHAPE, "--survivors", "a,b"),
     ("--survivors: expected comma-separated device ids such as 0,1,3, got 'a,b'",)),
    ("reshape --survivors empty", _with(RESHAPE, "--survivors", ""),
     ("--survivors: expected at least one device id",)),
    ("reshape --new-devices words", _with(RESHAPE, "--new-devices", "x"),
     ("--new-devices: expected comma-separated device ids",)),
    ("reshape --staging-mib 0", _with(RESHAPE, "--staging-mib", "0"),
     ("--staging-mib: must be a finite number > 0, got 0",)),
    ("reshape --staging-mib nan", _with(RESHAPE, "--staging-mib", "nan"),
     ("--staging-mib: must be a finite number > 0, got nan",)),
    ("reshape --staging-mib inf", _with(RESHAPE, "--staging-mib", "inf"),
     ("--staging-mib: must be a finite number > 0, got inf",)),
    ("reshape without --to", RESHAPE[:3], ("the following arguments are required: --to",)),
    ("simulate --tokens 0", _with(SIMULATE, "--tokens", "0"),
     ("--tokens: must be a finite number > 0, got 0",)),
    ("simulate --tokens nan", _with(SIMULATE, "--tokens", "nan"), ("must be a finite number > 0",)),
    ("simulate --tokens inf", _with(SIMULATE, "--tokens", "inf"), ("must be a finite number > 0",)),
    ("simulate --tokens absurd", _with(SIMULATE, "--tokens", "1e300"),
     ("--tokens: 1e300 is above the limit of 1e+15 tokens",)),
    ("simulate --tokens a word", _with(SIMULATE, "--tokens", "lots"),
     ("--tokens: must be a number, got 'lots'",)),
    ("simulate --runs 0", _with(SIMULATE, "--runs", "0"), ("--runs: must be at least 1, got 0",)),
    ("simulate --runs absurd", _with(SIMULATE, "--runs", "1000000000000"),
     ("--runs: 1000000000000 is above the limit of 4,096 runs",)),
    ("simulate --seed negative", _with(SIMULATE, "--seed", "-1"),
     ("--seed: must be 0 or more, got -1",)),
    ("simulate --deadline 0", _with(SIMULATE, "--deadline", "0"),
     ("--deadline: must be a finite number > 0, got 0",)),
    ("simulate --global-batch 0", _with(SIMULATE, "--global-batch", "0"),
     ("--global-batch: must be at least 1, got 0",)),
    ("simulate --policy unknown", _with(SIMULATE, "--policy", "fast"),
     ("--policy/--strategy: invalid Policy value: 'fast'",)),
    ("simulate --zones empty", [*SIMULATE, "--zones", ""],
     ("--zones: expected auto or comma-separated zones such as us-central1-a,us-east4-b, got ''",)),
    ("simulate --zones commas", [*SIMULATE, "--zones", " , "], ("--zones: expected auto", "got ' , '")),
    ("simulate --preemption unknown", _with(SIMULATE, "--preemption", "often"),
     ("--preemption: invalid PreemptionMode value: 'often'",)),
    ("simulate without --tokens", ["simulate", "--model", "gpt3-125m", "--cluster", "h100:1x8"],
     ("the following arguments are required: --tokens",)),
    ("advise --tokens 0", _with(ADVISE, "--tokens", "0"), ("--tokens: must be a finite number > 0",)),
    ("advise --tokens negative", _with(ADVISE, "--tokens", "-1"),
     ("--tokens: must be a finite number > 0, got -1",)),
    ("advise --tokens absurd", _with(ADVISE, "--tokens", "1e20"),
     ("--tokens: 1e20 is above the limit of 1e+15 tokens",)),
    ("advise --deadline negative", _with(ADVISE, "--deadline", "-1"),
     ("--deadline: must be a finite number > 0, got -1",)),
    ("advise --budget 0", _with(ADVISE, "--budget", "0"), ("--budget: must be a finite number > 0",)),
    ("advise --budget nan", _with(ADVISE, "--budget", "nan"),
     ("--budget: must be a finite number > 0, got nan",)),
    ("advise --runs 0", _with(ADVISE, "--runs", "0"), ("--runs: must be at least 1, got 0",)),
    ("advise --runs absurd", _with(ADVISE, "--runs", "99999999999"),
     ("--runs: 99999999999 is above the limit of 4,096 runs",)),
    ("timeline --pp 0", _with(TIMELINE, "--pp", "0"), ("--pp: must be at least 1, got 0",)),
    ("timeline --microbatches 0", _with(TIMELINE, "--microbatches", "0"),
     ("--microbatches: must be at least 1, got 0",)),
    ("timeline --vpp 0", _with(TIMELINE, "--vpp", "0"), ("--vpp: must be at least 1, got 0",)),
    ("timeline --schedule unknown", _with(TIMELINE, "--schedule", "fast"),
     ("--schedule: invalid choice: 'fast'",)),
    ("streams --batch a word", ["streams", "--batch", "some"], ("--batch: invalid int value",)),
    ("streams --max-streams a word", ["streams", "--max-streams", "few"],
     ("--max-streams: invalid int value",)),
    ("streams --method unknown", ["streams", "--method", "greedy"],
     ("--method: invalid choice: 'greedy'",)),
    ("streams --timing unknown", ["streams", "--timing", "guess"],
     ("--timing: invalid choice: 'guess'",)),
    ("profile --nproc 0", ["profile", "--nproc", "0"], ("--nproc: must be at least 1, got 0",)),
    ("profile --seq-len 0", ["profile", "--seq-len", "0"], ("--seq-len: must be at least 1, got 0",)),
    ("profile --seq-len a word", ["profile", "--seq-len", "long"],
     ("--seq-len: must be a whole number, got 'long'",)),
    ("validate --nproc 0", ["validate", "--nproc", "0"], ("--nproc: must be at least 1, got 0",)),
    ("validate --repeats 0", ["validate", "--repeats", "0"], ("--repeats: must be at least 1, got 0",)),
    ("validate --warmup negative", ["validate", "--warmup", "-1"], ("--warmup:", "got -1")),
    ("validate --plans 0", ["validate", "--plans", "0"], ("--plans: must be at least 1, got 0",)),
    ("validate --seq-len 0", ["validate", "--seq-len", "0"], ("--seq-len: must be at least 1, got 0",)),
    ("demo --nproc a word", ["demo", "--nproc", "four"], ("--nproc: invalid int value: 'four'",)),
    ("demo --steps a word", ["demo", "--steps", "many"], ("--steps: invalid int value: 'many'",)),
    ("no subcommand", [], ("the following arguments are required: COMMAND",)),
    ("unknown subcommand", ["train"], ("argument COMMAND: invalid choice: 'train'",)),
]


@pytest.mark.parametrize(("args", "needles"), [c[1:] for c in ARG_CASES],
                         ids=[c[0] for c in ARG_CASES])
def test_bad_flag_is_refused_by_argparse(capsys: pytest.CaptureFixture, args: list[str],
                                         needles: tuple[str, ...]) -> None:
    arg_refused(capsys, args, *needles)


# --- flags the subcommands refuse --------------------------------------------------------------
CLI_CASES: list[tuple[str, list[str], tuple[str, ...]]] = [
    ("plan --tolerance negative", _with(PLAN, "--tolerance", "-1"),
     ("--tolerance must be a finite fraction >= 0 (0 = exact), got -1.0",)),
    ("plan --tolerance inf", _with(PLAN, "--tolerance", "inf"),
     ("--tolerance must be a finite fraction >= 0 (0 = exact), got inf",)),
    ("plan --max-nodes negative", _with(PLAN, "--max-nodes", "-1"),
     ("--max-nodes must be 0 (no limit) or a positive count, got -1",)),
    ("plan cluster not a shape", _with(PLAN, "--cluster", "junk"),
     ("cannot read cluster 'junk': expected GPU:NODESxPER_NODE such as 'h100:8x8'",)),
    ("plan cluster without nodes", _with(PLAN, "--cluster", "h100"), ("cannot read cluster 'h100'",)),
    ("plan cluster trailing plus", _with(PLAN, "--cluster", "h100:1x8+"),
     ("cannot read cluster 'h100:1x8+'",)),
    ("plan cluster negative nodes", _with(PLAN, "--cluster", "h100:-1x8"),
     ("cannot read cluster 'h100:-1x8'",)),
    ("plan cluster of no GPU per node", _with(PLAN, "--cluster", "h100:1x0"),
     ("a node group needs at least one node of at least one GPU, got 1x0",)),
    ("plan cluster GPU unknown", _with(PLAN, "--cluster", "h900:1x8"),
     ("unknown GPU 'h900'; known: k80",)),
    ("plan absurd cluster", _with(PLAN, "--cluster", "h100:100000000x8"),
     ("no layout of 800000000 GPUs divides global batch 8",)),
    ("plan model unknown", _with(PLAN, "--model", "gpt-9"), ("unknown model 'gpt-9'; known models",)),
    ("plan model empty", _with(PLAN, "--model", ""), ("unknown model ''",)),
    ("plan factory module missing", _with(PLAN, "--model", "no_such_module_x:fn"),
     ("cannot import 'no_such_module_x' for model factory",)),
    ("plan factory function missing", _with(PLAN, "--model", "json:no_such_function"),
     ("'json' has no function 'no_such_function'",)),
    ("plan profile missing", [*PLAN, "--profile", "absent-profile.json"],
     ("profile file absent-profile.json does not exist", "meshmorph profile --out FILE")),
    ("estimate degrees above the world", _with(ESTIMATE, "--tp", "3"),
     ("tp 3 x pp 1 x dp 8 = 24 ranks, but the job has 8",)),
    ("estimate degrees below the world", _with(ESTIMATE, "--dp", "4"),
     ("tp 1 x pp 1 x dp 4 = 4 ranks, but the job has 8", "change a degree")),
    ("estimate tp not dividing heads", ["estimate", "--model", "gpt3-125m", "--cluster", "h100:1x8",
                                        "--tp", "8", "--pp", "1", "--dp", "1"],
     ("tp 8 does not divide num_heads 12 of gpt3-125m",)),
    ("estimate cp splitting a short sequence", ["estimate", "--model", "gpt3-125m", "--cluster",
                                                "h100:1x8", "--tp", "1", "--pp", "1", "--dp", "1",
                                                "--cp", "8", "--seq-len", "4"],
     ("cp 8 needs seq_len 4 to split into 2 x cp = 16 equal chunks",)),
    ("estimate vpp without interleaving", [*ESTIMATE, "--schedule", "1f1b", "--vpp", "2"],
     ("vpp 2 > 1 needs schedule 'interleaved', not '1f1b'",)),
    ("estimate batch not dividing", [*ESTIMATE, "--global-batch", "12"],
     ("global batch 12 is not divisible by dp 8 x micro-batch 1 = 8",)),
    ("estimate without a model", ["estimate", "--cluster", "h100:1x8"],
     ("estimate needs --model (or --plan FILE)",)),
    ("estimate plan a folder", ["estimate", "--cluster", "h100:1x8", "--plan", str(EXAMPLES)],
     ("is a folder; pass the path of a plan JSON file",)),
    ("reshape survivor twice", _with(RESHAPE, "--survivors", "0,0"),
     ("survivors [0, 0] list a rank twice",)),
    ("reshape survivor negative", _with(RESHAPE, "--survivors", "-1"),
     ("survivors [-1] are outside the old plan's ranks 0..3",)),
    ("reshape survivor outside", _with(RESHAPE, "--survivors", "99"),
     ("survivors [99] are outside the old plan's ranks 0..3",)),
    ("reshape new device a survivor", _with(RESHAPE, "--new-devices", "0"),
     ("new devices [0] must be distinct ids >= 0 that are not survivors (clash: [0])",)),
    ("reshape from missing", _with(RESHAPE, "--from", "absent.json"),
     ("plan file absent.json does not exist",)),
    ("reshape from a folder", _with(RESHAPE, "--from", str(EXAMPLES)), ("is a folder",)),
    ("reshape cluster unreadable", [*RESHAPE, "--cluster", "junk"], ("cannot read cluster 'junk'",)),
    ("reshape cluster too small", [*RESHAPE, "--cluster", "h100:1x1"],
     ("the move uses device 3 but cluster h100:1x1 has 1 devices; give a larger --cluster",)),
    ("reshape profile missing", [*RESHAPE, "--profile", "absent.json"],
     ("profile file absent.json does not exist",)),
    ("reshape to another model", _with(RESHAPE, "--to", str(PLANS / "megatron-gpt3-175b.json")),
     ("a reshape keeps the model: give two plans for the same model",)),
    ("simulate zone unknown", [*SIMULATE, "--zones", "mars-1a"],
     ("unknown zone mars-1a for h100 on gcp-spot", "[[zones]]")),
    ("simulate trace missing", [*SIMULATE, "--trace", "absent.json"],
     ("trace file absent.json does not exist", "h100-gcp-2025-10")),
    ("simulate provider unknown", [*SIMULATE, "--provider", "nosuch"],
     ("unknown cloud provider 'nosuch'", "[providers.NAME]")),
    ("simulate model unknown", _with(SIMULATE, "--model", "gpt-9"), ("unknown model 'gpt-9'",)),
    ("simulate batch no plan fits", [*SIMULATE, "--global-batch", "999999999999999"],
     ("no plan of gpt3-125m fits h100:1x8",)),
    ("simulate cluster of no node", _with(SIMULATE, "--cluster", "h100:0x8"),
     ("a node group needs at least one node",)),
    ("simulate deadline policy without hours", [*SIMULATE, "--policy", "deadline"],
     ("--policy deadline needs --deadline HOURS",)),
    ("simulate policy without spot", [*SIMULATE[:-1], "--policy", "reshape"],
     ("--policy reshape handles preemptions of spot nodes", "add --spot")),
    ("simulate gpus file missing", [*SIMULATE, "--gpus", "absent.toml"],
     ("GPU file absent.toml does not exist",)),
    ("advise model unknown", _with(ADVISE, "--model", "x"), ("unknown model 'x'",)),
    ("advise gpus file a folder", [*ADVISE, "--gpus", str(EXAMPLES)], ("is a folder",)),
    ("timeline without a schedule", ["timeline"],
     ("timeline needs --plan FILE, or --schedule NAME --pp P --microbatches M",)),
    ("timeline pp alone", ["timeline", "--pp", "4"], ("timeline needs --plan FILE",)),
    ("timeline interleaved with one chunk", _with(TIMELINE, "--schedule", "interleaved"),
     ("--schedule interleaved places --vpp chunks on each rank: give --vpp 2 or more",)),
    ("timeline absurd micro-batches", _with(TIMELINE, "--microbatches", "1000000000"),
     ("4,000,000,000 (stage, micro-batch) pairs is above the 65,536 a readable chart takes",)),
    ("timeline absurd pp", _with(TIMELINE, "--pp", "100000000"),
     ("is above the 65,536 a readable chart takes",)),
    ("timeline absurd vpp", [*_with(TIMELINE, "--schedule", "interleaved"), "--vpp", "1000000000"],
     ("x 1000000000 chunk(s)", "a readable chart takes")),
    ("timeline compare missing", ["timeline", "--compare", "absent-run"],
     ("does not exist; write one with 'meshmorph run --trace'",)),
    ("timeline compare a file", ["timeline", "--compare", str(EXAMPLES / "README.md")],
     ("README.md/trace.json does not exist",)),
    ("timeline plan missing", ["timeline", "--plan", "absent.json"],
     ("plan file absent.json does not exist",)),
    ("timeline plan without cluster", ["timeline", "--plan", str(PLANS / "reshape-tp2-pp2.json")],
     ("does not name its cluster; pass --cluster",)),
    ("timeline cluster unreadable", ["timeline", "--plan", str(PLANS / "reshape-tp2-pp2.json"),
                                     "--cluster", "junk"], ("cannot read cluster 'junk'",)),
    ("streams batch 0", ["streams", "--batch", "0"], ("batch must be positive, got 0",)),
    ("streams batch negative", ["streams", "--batch", "-1"], ("batch must be positive, got -1",)),
    ("streams absurd batch", ["streams", "--batch", "100000000000"],
     ("is 307,200,000,000,000 input values, above meshmorph's limit of 16,777,216",
      "pass a smaller --batch")),
    ("streams absurd input shape", ["streams", "--input-shape", "100000,100000,100000"],
     ("above meshmorph's limit of 16,777,216",)),
    ("streams --max-streams 0", ["streams", "--max-streams", "0"],
     ("--max-streams must be at least 1, got 0",)),
    ("streams --max-streams negative", ["streams", "--max-streams", "-2"],
     ("--max-streams must be at least 1, got -2",)),
    ("streams input shape words", ["streams", "--input-shape", "a,b"],
     ("--input-shape 'a,b' must be comma-separated integers",)),
    ("streams input shape of zero", ["streams", "--input-shape", "0,3,3"],
     ("--input-shape '0,3,3' needs positive sizes",)),
    ("streams net unknown", ["streams", "--model", "nosuch"],
     ("unknown net 'nosuch'; choose one of inception-stack",)),
    ("streams factory function missing", ["streams", "--model", "json:nofn"],
     ("'json' has no function 'nofn'",)),
    ("streams factory module missing", ["streams", "--model", "no_such_module_x:fn"],
     ("cannot import 'no_such_module_x'",)),
    ("profile model unknown", ["profile", "--model", "nosuch"], ("unknown model 'nosuch'",)),
    ("profile absurd seq-len", ["profile", "--seq-len", "1000000000"],
     ("seq_len 1,000,000,000 is above meshmorph's limit of 16,777,216",)),
    ("validate model unknown", ["validate", "--model", "nosuch"], ("unknown model 'nosuch'",)),
    ("validate profile missing", ["validate", "--profile", "absent.json"],
     ("profile file absent.json does not exist",)),
    ("validate absurd seq-len", ["validate", "--seq-len", "1000000000"],
     ("seq_len 1,000,000,000 is above meshmorph's limit",)),
    ("validate absurd process count", ["validate", "--nproc", "100000"],
     ("only 0 runnable plans of gpt-small on 100000 processes",)),
    ("demo steps 0", ["demo", "--steps", "0"], ("demo needs --nproc >= 1 and --steps >= 1",)),
]


@pytest.mark.parametrize(("args", "needles"), [c[1:] for c in CLI_CASES],
                         ids=[c[0] for c in CLI_CASES])
def test_bad_flag_is_refused_by_the_subcommand(capsys: pytest.CaptureFixture, args: list[str],
                                               needles: tuple[str, ...]) -> None:
    refused(capsys, args, *needles)


# --- meshmorph run and demo: flags checked before anything is launched -------------------------
RUN_CASES: list[tuple[str, list[str], tuple[str, ...]]] = [
    ("elastic not a range", ["--elastic", "x"],
     ("--elastic takes MIN:MAX nodes with 1 <= MIN <= MAX, got 'x'",)),
    ("elastic reversed", ["--elastic", "3:2"], ("with 1 <= MIN <= MAX, got '3:2'",)),
    ("elastic of no node", ["--elastic", "0:2"], ("with 1 <= MIN <= MAX, got '0:2'",)),
    ("failure not RANK@STEP", ["--inject-failure", "x"],
     ("--inject-failure takes RANK@STEP (e.g. 3@4, step >= 1), got 'x'",)),
    ("failure at step 0", ["--inject-failure", "0@0"], ("step >= 1), got '0@0'",)),
    ("failure without elastic", ["--nproc", "2", "--inject-failure", "1@3"],
     ("--inject-failure needs --elastic",)),
    ("node rank without elastic", ["--node-rank", "1"],
     ("--node-rank and --rdzv-endpoint go together, with --elastic MIN:MAX",)),
    ("rendezvous id without node rank", ["--rdzv-id", "x"],
     ("--node-rank and --rdzv-endpoint go together",)),
    ("node rank negative", ["--elastic", "1:2", "--node-rank", "-1", "--rdzv-endpoint", "h:1"],
     ("--node-rank -1 must be 0 to 1",)),
    ("endpoint without port", ["--elastic", "1:2", "--node-rank", "0", "--rdzv-endpoint", "host"],
     ("--rdzv-endpoint takes HOST:PORT, got 'host'",)),
    ("endpoint port out of range", ["--elastic", "1:2", "--node-rank", "0", "--rdzv-endpoint",
                                    "h:99999"], ("--rdzv-endpoint takes HOST:PORT, got 'h:99999'",)),
    ("processes not dividing the batch", ["--nproc", "3"],
     ("global_batch 8 is not divisible by dp 3 x micro_batch 2 = 6",)),
    ("absurd process count", ["--nproc", "100000"],
     ("global_batch 8 is not divisible by dp 100000",)),
    ("plan file missing", ["--plan", "absent.json"], ("plan file absent.json does not exist",)),
    ("plan file a folder", ["--plan", str(EXAMPLES)], ("is a folder",)),
    ("plan of another model", ["--nproc", "4", "--plan", str(PLANS / "reshape-tp2-pp2.json")],
     ("gpt-small",)),
]


@pytest.mark.parametrize(("args", "needles"), [c[1:] for c in RUN_CASES],
                         ids=[c[0] for c in RUN_CASES])
def test_bad_run_flag_is_refused_before_launch(tmp_path: Path, capsys: pytest.CaptureFixture,
                                               args: list[str], needles: tuple[str, ...]) -> None:
    job = write(tmp_path / "job.toml", JOB)
    refused(capsys, ["run", "--config", str(job), "--out", str(tmp_path / "out"), *args], *needles)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("args", "needle"), [
    (["--nproc", "100000"], "global_batch 16 is not divisible by dp 100000"),
    (["--steps", "0"], "got --nproc 4, --steps 0"),
])
def test_bad_demo_flag_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture, args: list[str],
                                  needle: str) -> None:
    refused(capsys, ["demo", "--out", str(tmp_path / "demo"), *args], needle)


def test_a_demo_into_a_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    blocker = write(tmp_path / "notes.txt", "keep me")
    refused(capsys, ["demo", "--out", str(blocker)], f"run folder {blocker} is a file",
            "choose another --out")
    assert blocker.read_text() == "keep me"


# --- outputs that cannot be written, refused before any work -----------------------------------
OUTPUTS: list[tuple[list[str], str]] = [
    (PLAN, "--json"), (PLAN, "--chart"), (ESTIMATE, "--json"), (ESTIMATE, "--chart"),
    (RESHAPE, "--json"), (RESHAPE, "--png"), ([*SIMULATE, "--runs", "2"], "--json"),
    ([*SIMULATE, "--runs", "2"], "--png"), (ADVISE, "--json"), (TIMELINE, "--png"),
    (TIMELINE, "--trace"), (["streams"], "--json"), (["streams"], "--png"), (["profile"], "--out"),
    (["validate"], "--json"), (["validate"], "--png"), (["gpus"], "--json"), (["models"], "--json"),
]
OUTPUT_CASES = [(args, flag, kind) for args, flag in OUTPUTS for kind in ("folder", "under a file")
                if (args[0], flag, kind) not in {("estimate", "--json", "under a file"),
                                                 ("estimate", "--chart", "under a file"),
                                                 ("models", "--json", "folder")}]


@pytest.mark.parametrize(("args", "flag", "kind"), OUTPUT_CASES,
                         ids=[f"{a[0]} {f} {k}" for a, f, k in OUTPUT_CASES])
def test_an_output_that_cannot_be_written_is_refused_before_any_work(
        tmp_path: Path, capsys: pytest.CaptureFixture, args: list[str], flag: str,
        kind: str) -> None:
    blocker = write(tmp_path / "notes.txt", "keep me")
    (tmp_path / "out").mkdir()
    target = tmp_path / "out" if kind == "folder" else blocker / "out.json"
    needle = f"{flag} {target} is a folder" if kind == "folder" else \
        f"{flag} {target}: {blocker} is not a folder"
    err = refused(capsys, [*args, flag, str(target)], needle)
    assert "pass a" in err and blocker.read_text() == "keep me"
    assert list((tmp_path / "out").iterdir()) == []
