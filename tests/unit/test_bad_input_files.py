"""Bad files through the real command line, one table per format: job TOML (``run``), plan JSON
(``estimate --plan``), cluster TOML (``estimate --cluster``), Hugging Face config.json
(``estimate --model``), GPU TOML (``gpus --gpus``), cloud catalog TOML (``simulate --catalog``),
profile JSON (``estimate --profile``) and spot traces (``simulate --trace``). Each file is empty,
binary, of the wrong type, has unknown keys, NaN, infinite, zero, negative or absurd values, or
is a folder; each must end with exit code 2 and one message naming the constraint, no traceback,
no process started and no output written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from meshmorph.cli import main as cli_main
from tests.helpers.bad_input import BINARY, forbid_processes, refused, write
from tests.helpers.jobs import EXAMPLES, gpt_tiny_job

Content = str | bytes | dict[str, Any] | list[Any]
PLANS = EXAMPLES / "plans"


@pytest.fixture(autouse=True)
def _no_process_may_start(monkeypatch: pytest.MonkeyPatch) -> None:
    forbid_processes(monkeypatch)


def _table(cases: list[tuple[str, Content, tuple[str, ...]]]) -> Any:
    return pytest.mark.parametrize(("content", "needles"), [c[1:] for c in cases],
                                   ids=[c[0] for c in cases])


def _json_with(data: dict[str, Any], old: str, new: str) -> str:
    text = json.dumps(data)
    assert old in text
    return text.replace(old, new)


# --- job files (meshmorph run) -----------------------------------------------------------------
JOB = gpt_tiny_job(steps=4, optim={"lr": 1e-3, "grad_clip": 1.0})


def _job(old: str, new: str) -> str:
    assert old in JOB
    return JOB.replace(old, new)


JOB_CASES: list[tuple[str, Content, tuple[str, ...]]] = [
    ("fp8 recipe on fp32", _job("micro_batch = 2", 'micro_batch = 2\nfp8_scaling = "rowwise"'),
     ("[train] fp8_scaling 'rowwise' applies to dtype fp8, not 'fp32'",
      'set dtype = "fp8" or leave fp8_scaling out')),
    ("fp8 recipe unknown", _job("micro_batch = 2",
                                'micro_batch = 2\ndtype = "fp8"\nfp8_scaling = "blockwise"'),
     ("[train] fp8_scaling must be one of tensorwise, rowwise, rowwise_with_gw_hp, got "
      "'blockwise'",)),
    ("dtype fp4", _job("micro_batch = 2", 'micro_batch = 2\ndtype = "fp4"'),
     ("[train] dtype must be fp32, bf16, fp16 or fp8, got 'fp4'",)),
    ("checkpoint every -1", JOB + "[checkpoint]\nevery = -1\n",
     ("[checkpoint] needs every >= 0 and keep >= 1, got every -1",)),
    ("checkpoint keep 0", JOB + "[checkpoint]\nkeep = 0\n", ("keep >= 1", "keep 0")),
    ("checkpoint dir absolute", JOB + '[checkpoint]\nevery = 2\ndir = "/etc"\n',
     ("[checkpoint] dir must be a folder inside the run folder", "got '/etc'")),
    ("checkpoint dir empty", JOB + '[checkpoint]\nevery = 2\ndir = ""\n',
     ("[checkpoint] dir must be a folder inside the run folder", "got ''")),
    ("checkpoint dir escapes", JOB + '[checkpoint]\nevery = 2\ndir = "../../x"\n',
     ("without '..'", "got '../../x'", "leave it out")),
    ("checkpoint dir is the run folder", JOB + '[checkpoint]\nevery = 2\ndir = "."\n',
     ("[checkpoint] dir must be a folder inside the run folder", "got '.'")),
    ("out_dir empty", JOB + '[run]\nout_dir = ""\n', ("[run] out_dir must name a folder",)),
    ("timeout nan", JOB + "[run]\ncollective_timeout_s = nan\n",
     ("collective_timeout_s must be a positive number of seconds, got nan",)),
    ("timeout inf", JOB + "[run]\ncollective_timeout_s = inf\n",
     ("collective_timeout_s must be a positive number of seconds, got inf",)),
    ("timeout negative", JOB + "[run]\ncollective_timeout_s = -5\n",
     ("collective_timeout_s must be a positive number of seconds, got -5.0",)),
    ("timeout string", JOB + '[run]\ncollective_timeout_s = "10"\n',
     ("[run] collective_timeout_s must be float, got '10'",)),
    ("model not a table", 'model = "gpt-tiny"\n[train]\nsteps = 1\nglobal_batch = 8\n',
     ("[model] must be a table, got str",)),
    ("no train section", JOB.split("[train]")[0], ("missing section [train]",)),
    ("run section unknown key", JOB + "[run]\nout = 'x'\n", ("unknown key 'out' in [run]",)),
    ("checkpoint unknown key", JOB + "[checkpoint]\nevry = 2\n",
     ("unknown key 'evry' in [checkpoint]", "known keys: every, keep, dir")),
    ("model unknown key", _job("seq_len = 32", "seq_len = 32\nlayers = 2"),
     ("unknown key 'layers' in [model]",)),
    ("model missing source", _job('source = "gpt-tiny"\n', ""), ("[model] is incomplete", "source")),
    ("train missing global_batch", _job("global_batch = 8\n", ""),
     ("[train] is incomplete", "global_batch")),
    ("absurd seq_len", _job("seq_len = 32", "seq_len = 99999999999999999"),
     ("seq_len 99,999,999,999,999,999 is above meshmorph's limit",)),
    ("absurd global_batch", _job("global_batch = 8", "global_batch = 999999999999"),
     ("micro_batch 2 does not divide global_batch 999999999999",)),
    ("zero global_batch", _job("global_batch = 8", "global_batch = 0"),
     ("[train] global_batch must be at least 1, got 0",)),
    ("zero micro_batch", _job("micro_batch = 2", "micro_batch = 0"),
     ("[train] micro_batch must be at least 1, got 0",)),
    ("micro_batch above global_batch", _job("micro_batch = 2", "micro_batch = 16"),
     ("micro_batch 16 does not divide global_batch 8",)),
    ("steps float", _job("steps = 4", "steps = 4.0"), ("[train] steps must be int, got 4.0",)),
    ("steps bool", _job("steps = 4", "steps = true"), ("[train] steps must be int, got True",)),
    ("steps array", _job("steps = 4", "steps = [4]"), ("[train] steps must be int, got [4]",)),
    ("steps inline table", _job("steps = 4", "steps = {a = 1}"), ("[train] steps must be int",)),
    ("steps a date", _job("steps = 4", "steps = 2024-01-01"),
     ("[train] steps must be int, got datetime.date",)),
    ("seq_len float", _job("seq_len = 32", "seq_len = 32.5"),
     ("[model] seq_len must be int, got 32.5",)),
    ("data seed negative", _job("seed = 1", "seed = -1"), ("[data] seed must be 0 or more, got -1",)),
    ("data seed float", _job("seed = 1", "seed = 1.5"), ("[data] seed must be int, got 1.5",)),
    ("train seed string", _job("micro_batch = 2", 'micro_batch = 2\nseed = "x"'),
     ("[train] seed must be int, got 'x'",)),
    ("source int", _job('source = "gpt-tiny"', "source = 3"), ("[model] source must be str, got 3",)),
    ("source empty", _job('source = "gpt-tiny"', 'source = ""'), ("unknown model ''", "known models")),
    ("source config missing", _job('source = "gpt-tiny"', 'source = "nope/config.json"'),
     ("model config nope/config.json does not exist", "catalog name")),
    ("source factory missing", _job('source = "gpt-tiny"', 'source = "no_such_module_x:build"'),
     ("cannot import 'no_such_module_x'", "package.module:function")),
    ("data kind unknown", _job('kind = "synthetic"', 'kind = "images"'),
     ("[data] kind must be 'synthetic' or 'text', got 'images'",)),
    ("text without path", _job('kind = "synthetic"', 'kind = "text"'),
     ("[data] kind = 'text' needs a path to a text file",)),
    ("data path a folder", _job('kind = "synthetic"', 'kind = "text"\npath = "."'),
     ("is a folder; fix [data] path",)),
    ("data file empty", _job('kind = "synthetic"', 'kind = "text"\npath = "empty.txt"'),
     ("holds 0 bytes, fewer than one sample of seq_len + 1 = 33", "use a longer file")),
    ("data file too short", _job('kind = "synthetic"', 'kind = "text"\npath = "short.txt"'),
     ("holds 2 bytes, fewer than one sample",)),
    ("lr zero", _job("lr = 0.001", "lr = 0"), ("[optim] needs 0 <= min_lr <= lr and lr > 0",)),
    ("lr string", _job("lr = 0.001", 'lr = "0.001"'), ("[optim] lr must be float, got '0.001'",)),
    ("beta1 negative", _job("grad_clip = 1.0", "beta1 = -0.1"),
     ("[optim] beta1 must lie in [0, 1), got -0.1",)),
    ("beta1 one", _job("grad_clip = 1.0", "beta1 = 1.0"), ("[optim] beta1 must lie in [0, 1), got 1.0",)),
    ("eps zero", _job("grad_clip = 1.0", "eps = 0"), ("[optim] eps must be positive, got 0.0",)),
    ("eps nan", _job("grad_clip = 1.0", "eps = nan"), ("[optim] eps must be a finite number, got nan",)),
    ("weight_decay negative", _job("grad_clip = 1.0", "weight_decay = -0.1"),
     ("[optim] weight_decay must be >= 0, got -0.1",)),
    ("weight_decay nan", _job("grad_clip = 1.0", "weight_decay = nan"),
     ("[optim] weight_decay must be a finite number, got nan",)),
    ("warmup negative", _job("grad_clip = 1.0", "warmup_steps = -1"),
     ("[optim] warmup_steps must be >= 0 and decay_steps >= 1, got -1",)),
    ("decay_steps zero", _job("grad_clip = 1.0", "decay_steps = 0"),
     ("warmup_steps must be >= 0 and decay_steps >= 1",)),
    ("min_lr above lr", _job("grad_clip = 1.0", "min_lr = 1.0"),
     ("[optim] needs 0 <= min_lr <= lr", "set min_lr at most lr")),
    ("min_lr nan", _job("grad_clip = 1.0", "min_lr = nan"),
     ("[optim] min_lr must be a finite number, got nan",)),
    ("grad_clip nan", _job("grad_clip = 1.0", "grad_clip = nan"),
     ("[optim] grad_clip must be a finite number, got nan",)),
    ("grad_clip inf", _job("grad_clip = 1.0", "grad_clip = inf"),
     ("[optim] grad_clip must be a finite number, got inf",)),
    ("optim unknown key", _job("grad_clip = 1.0", "momentum = 0.9"),
     ("unknown key 'momentum' in [optim]", "known keys: lr")),
    ("duplicate key", _job("steps = 4", "steps = 4\nsteps = 5"), ("not valid TOML", "examples/jobs/")),
    ("utf-16 text", JOB.encode("utf-16"), ("not valid TOML",)),
    ("section as array of tables", JOB.replace("[train]", "[[train]]"),
     ("[train] must be a table, got list",)),
    ("compile_backend int", _job("micro_batch = 2", "micro_batch = 2\ncompile_backend = 1"),
     ("[train] compile_backend must be str, got 1",)),
    # absurd values that can only be typos: each bound named, with the way out
    ("absurd lr", _job("lr = 0.001", "lr = 1e10"),
     ("[optim] lr = 1e10 is above 10, a rate no model trains at", "e.g. lr = 3e-4")),
    ("lr just above the bound", _job("lr = 0.001", "lr = 10.5"), ("[optim] lr = 10.5 is above 10",)),
    ("absurd steps", _job("steps = 4", "steps = 10000000000000000"),
     ("[train] steps = 10,000,000,000,000,000 is above 1,000,000,000",
      "give the number of optimizer steps")),
    ("steps as 1e16", _job("steps = 4", "steps = 1e16"), ("[train] steps must be int, got 1e+16",)),
    ("absurd warmup", _job("grad_clip = 1.0", "warmup_steps = 99999999999"),
     ("[optim] warmup_steps = 99,999,999,999 is above 1,000,000,000",)),
    ("absurd decay_steps", _job("grad_clip = 1.0", "decay_steps = 1000000000000"),
     ("[optim] decay_steps = 1,000,000,000,000 is above 1,000,000,000",)),
    ("absurd timeout", JOB + "[run]\ncollective_timeout_s = 1e300\n",
     ("[run] collective_timeout_s = 1e+300 is above 86,400 s (a day)", "leave it out (120)")),
]


@_table(JOB_CASES)
def test_bad_job_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture, content: Content,
                                 needles: tuple[str, ...]) -> None:
    write(tmp_path / "empty.txt", "")
    write(tmp_path / "short.txt", "ab")
    job = write(tmp_path / "job.toml", content)
    refused(capsys, ["run", "--config", str(job), "--nproc", "2", "--out", str(tmp_path / "out")],
            *needles)
    assert not (tmp_path / "out").exists()


def test_a_job_file_that_is_a_folder_is_named_as_one(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture) -> None:
    refused(capsys, ["run", "--config", str(tmp_path), "--out", str(tmp_path / "out")],
            f"job file {tmp_path} is a folder", "examples/jobs/")


# --- plan files (meshmorph estimate --plan) ----------------------------------------------------
PLAN = {"model": "gpt-tiny", "seq_len": 32, "global_batch": 8, "tp": 1, "pp": 1, "dp": 2,
        "zero": 2, "micro_batch": 2, "num_microbatches": 2, "schedule": "1f1b", "vpp": 1,
        "sequence_parallel": False, "dtype": "bf16", "reduce_dtype": "fp32", "world_size": 2}

PLAN_CASES: list[tuple[str, Content, tuple[str, ...]]] = [
    ("empty object", {}, ("does not hold a valid plan", "'model', 'seq_len', and 'global_batch'")),
    ("null", "null", ("must hold a JSON object, got NoneType",)),
    ("a string", '"plan"', ("must hold a JSON object, got str",)),
    ("plans not a list", {"plans": {"a": 1}}, ("lists no plans under 'plans'",)),
    ("plans of numbers", {"plans": [1]}, ("must hold a JSON object in 'plans', got int",)),
    ("tp 0", {**PLAN, "tp": 0}, ("tp must be at least 1, got 0",)),
    ("pp 0", {**PLAN, "pp": 0}, ("pp must be at least 1, got 0",)),
    ("cp 0", {**PLAN, "cp": 0}, ("cp must be at least 1, got 0",)),
    ("vpp 0", {**PLAN, "vpp": 0}, ("vpp must be at least 1, got 0",)),
    ("predicted not an object", {**PLAN, "predicted": "fast"},
     ("predicted must be an object of figures", "leave it out")),
    ("zero 5", {**PLAN, "zero": 5}, ("zero must be 0, 1, 2 or 3, got 5",)),
    ("zero -1", {**PLAN, "zero": -1}, ("zero must be 0, 1, 2 or 3, got -1",)),
    ("micro_batch 0", {**PLAN, "micro_batch": 0}, ("micro_batch must be at least 1, got 0",)),
    ("num_microbatches 0", {**PLAN, "num_microbatches": 0},
     ("num_microbatches must be at least 1, got 0",)),
    ("batch does not add up", {**PLAN, "global_batch": 9},
     ("global_batch 9 != dp 2 x micro_batch 2 x num_microbatches 2 = 8",)),
    ("seq_len 0", {**PLAN, "seq_len": 0}, ("seq_len must be at least 1, got 0",)),
    ("absurd seq_len", {**PLAN, "seq_len": 10**12}, ("above meshmorph's limit of 16,777,216",)),
    ("absurd micro-batch count", {**PLAN, "global_batch": 10**15, "num_microbatches": 10**15 // 4},
     ("(stage, micro-batch) pairs is above the 2,097,152 a schedule takes",)),
    ("absurd dp", {**PLAN, "dp": 10**12}, ("global_batch 8 != dp 1000000000000",)),
    ("schedule unknown", {**PLAN, "schedule": "magic"},
     ("schedule must be one of gpipe, 1f1b", "got 'magic'")),
    ("schedule a number", {**PLAN, "schedule": 3}, ("schedule must be one of", "got 3")),
    ("model a number", {**PLAN, "model": 3}, ("model must name a model", "got 3")),
    ("model empty", {**PLAN, "model": ""}, ("model must name a model", "got ''")),
    ("model unknown", {**PLAN, "model": "gpt-99"}, ("unknown model 'gpt-99'",)),
    ("sequence_parallel a string", {**PLAN, "sequence_parallel": "yes"},
     ("sequence_parallel must be true or false, got 'yes'",)),
    ("vpp without interleaving", {**PLAN, "vpp": 2},
     ("vpp 2 > 1 needs schedule 'interleaved', not '1f1b'",)),
    ("zbv without two chunks", {**PLAN, "schedule": "zbv"},
     ("schedule zbv places two chunks per rank in a V: set vpp 2",)),
    ("weight prediction without async", {**PLAN, "weight_prediction": "adam"},
     ("weight_prediction 'adam' applies only to schedule 'async'",)),
    ("reduce_dtype unknown", {**PLAN, "reduce_dtype": "int8"},
     ("reduce_dtype must be one of bf16, fp16, fp32, fp8, got 'int8'",)),
    ("reduce_dtype fp8", {**PLAN, "reduce_dtype": "fp8"},
     ("reduce_dtype fp8: gradients are reduced in fp32 or a 16-bit dtype",)),
    ("world_size disagrees", {**PLAN, "world_size": 7},
     ("plan says world_size 7 but tp x pp x dp = 2",)),
    ("stages not a list", {**PLAN, "stages": 3}, ("'stages' must be a list of objects",)),
    ("stages of the wrong count", {**PLAN, "stages": [{"layers": [0, 3]}, {"layers": [3, 6]}]},
     ("does not hold a valid plan",)),
    ("tp a string", {**PLAN, "tp": "1.0"}, ("tp must be an integer, got '1.0'",)),
    ("utf-16 text", json.dumps(PLAN).encode("utf-16"), ("is not text (binary data)",)),
    ("NaN literal", _json_with(PLAN, '"seq_len": 32', '"seq_len": NaN'),
     ("seq_len must be an integer, got nan",)),
    ("Infinity literal", _json_with(PLAN, '"dp": 2', '"dp": Infinity'),
     ("dp must be an integer, got inf",)),
    ("nested past the parser", "[" * 100_000 + "]" * 100_000,
     ("is not valid JSON: it nests deeper than Python can read", "meshmorph plan --json")),
    ("an integer of 5000 digits", _json_with(PLAN, '"dp": 2', '"dp": ' + "9" * 5000),
     ("is not valid JSON", "4300 digits", "meshmorph plan --json")),
    ("trailing garbage", json.dumps(PLAN) + "}", ("is not valid JSON", "Extra data")),
]


@_table(PLAN_CASES)
def test_bad_plan_file_is_refused_by_estimate(tmp_path: Path, capsys: pytest.CaptureFixture,
                                              content: Content, needles: tuple[str, ...]) -> None:
    plan = write(tmp_path / "plan.json", content)
    before = plan.read_bytes()
    refused(capsys, ["estimate", "--cluster", "h100:1x2", "--plan", str(plan), "--json",
                     str(tmp_path / "out.json")], *needles)
    assert plan.read_bytes() == before and not (tmp_path / "out.json").exists()


def test_a_plan_file_that_is_a_folder_is_named_as_one(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    refused(capsys, ["estimate", "--cluster", "h100:1x2", "--plan", str(tmp_path)],
            f"plan file {tmp_path} is a folder")


# --- cluster files (meshmorph estimate --cluster FILE.toml) ------------------------------------
GROUP = '[[groups]]\ngpu = "h100"\nnodes = 1\ngpus_per_node = 8\n'


def _group(old: str, new: str) -> str:
    assert old in GROUP
    return GROUP.replace(old, new)


CLUSTER_CASES: list[tuple[str, Content, tuple[str, ...]]] = [
    ("gpus_per_node 0", _group("gpus_per_node = 8", "gpus_per_node = 0"),
     ("gpus_per_node in [[groups]] #1 must be a positive integer, got 0",)),
    ("gpus_per_node float", _group("gpus_per_node = 8", "gpus_per_node = 8.0"),
     ("gpus_per_node in [[groups]] #1 must be a positive integer, got 8.0",)),
    ("nodes bool", _group("nodes = 1", "nodes = true"),
     ("nodes in [[groups]] #1 must be a positive integer, got True",)),
    ("nodes zero", _group("nodes = 1", "nodes = 0"),
     ("nodes in [[groups]] #1 must be a positive integer, got 0",)),
    ("absurd node count", _group("nodes = 1", "nodes = 1000000000000"),
     ("the job has 8000000000000", "change a degree")),
    ("gpu missing", _group('gpu = "h100"\n', ""),
     ("[[groups]] #1 is missing gpu", "every group needs gpu, nodes, gpus_per_node")),
    ("nodes missing", _group("nodes = 1\n", ""), ("[[groups]] #1 is missing nodes",)),
    ("gpu a number", _group('"h100"', "3"), ("unknown gpu 3 in [[groups]] #1", "valid GPUs")),
    ("groups a number", "groups = 3\n", ("needs at least one [[groups]] table",)),
    ("groups an empty list", "groups = []\n", ("needs at least one [[groups]] table",)),
    ("groups of numbers", "groups = [1]\n", ("[[groups]] #1 must be a table, got 1",)),
    ("second group bad", GROUP + _group("nodes = 1", "nodes = -1"),
     ("nodes in [[groups]] #2 must be a positive integer, got -1",)),
    ("intra link unknown", GROUP + 'intra_node_link = "warp"\n',
     ("unknown intra_node_link 'warp' in [[groups]] #1", "valid links")),
    ("inter link unknown", 'inter_node_link = "warp"\n' + GROUP,
     ("unknown inter_node_link 'warp' in the top level", "valid links")),
    ("inter link a number", "inter_node_link = 5\n" + GROUP, ("unknown inter_node_link 5",)),
    ("inter_node not a table", "inter_node = 5\n" + GROUP, ("[inter_node] must be a table, got 5",)),
    ("inter_node unknown key", "[inter_node]\nspeed = 5\n" + GROUP,
     ("unknown key 'speed' in [inter_node]", "valid keys: bandwidth_gbps, latency_us")),
    ("inter latency negative", "[inter_node]\nlatency_us = -1\n" + GROUP,
     ("latency_us in [inter_node] must be a number >= 0, got -1",)),
    ("inter bandwidth zero", "[inter_node]\nbandwidth_gbps = 0\n" + GROUP,
     ("bandwidth_gbps in [inter_node] must be a positive number, got 0",)),
    ("transient a string", GROUP + 'transient = "yes"\n',
     ("transient in [[groups]] #1 must be true or false, got 'yes'",)),
    ("price negative", GROUP + "price_per_gpu_hour = -1\n",
     ("price_per_gpu_hour in [[groups]] #1 must be a number >= 0, got -1",)),
    ("price nan", GROUP + "price_per_gpu_hour = nan\n",
     ("price_per_gpu_hour in [[groups]] #1 must be a number >= 0, got nan",)),
    ("price a string", GROUP + 'price_per_gpu_hour = "2"\n',
     ("price_per_gpu_hour in [[groups]] #1 must be a number >= 0, got '2'",)),
    ("name a number", "name = 3\n" + GROUP, ("name must be a string, got 3",)),
    ("provider a number", "provider = 3\n" + GROUP, ("provider must be a string, got 3",)),
    ("top-level unknown key", "foo = 1\n" + GROUP,
     ("unknown key 'foo' in the top level", "valid keys: name")),
    ("gpus not a table", "gpus = 3\n" + GROUP, ("gpus must be a table of [gpus.NAME] tables, got 3",)),
    ("links not a table", "links = 3\n" + GROUP,
     ("links must be a table of [links.NAME] tables, got 3",)),
    ("new gpu incomplete", "[gpus.x]\nmemory_gib = 1\n" + GROUP,
     ("new GPU 'x' needs hbm_gbps, peak_tflops",)),
    ("own link without figures", '[links.mine]\nbandwidth_gbps = 5\n' + GROUP,
     ("new link 'mine' needs bandwidth_gbps and latency_us",)),
    ("intra bandwidth inf", GROUP + "intra_node_bandwidth_gbps = inf\n",
     ("intra_node_bandwidth_gbps in [[groups]] #1 must be a positive number, got inf",)),
    ("intra latency a string", GROUP + 'intra_node_latency_us = "1"\n',
     ("intra_node_latency_us in [[groups]] #1 must be a number >= 0, got '1'",)),
    ("utf-16 text", GROUP.encode("utf-16"), ("is not text (binary data)", "h100:4x8")),
    ("unclosed table header", "[[groups]\n", ("is not valid TOML", "examples/clusters/")),
]


@_table(CLUSTER_CASES)
def test_bad_cluster_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture,
                                     content: Content, needles: tuple[str, ...]) -> None:
    cluster = write(tmp_path / "cluster.toml", content)
    refused(capsys, ["estimate", "--model", "gpt3-125m", "--cluster", str(cluster), "--tp", "1",
                     "--pp", "1", "--dp", "8"], *needles)


def test_a_missing_cluster_file_is_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    refused(capsys, ["estimate", "--model", "gpt3-125m", "--cluster", str(tmp_path / "no.toml"),
                     "--tp", "1", "--pp", "1", "--dp", "8"],
            f"cluster file {tmp_path / 'no.toml'} does not exist", "h100:4x8")


# --- Hugging Face config.json (meshmorph estimate --model FILE) --------------------------------
HF_GPT = {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 256, "n_positions": 32}
HF_LLAMA = {"model_type": "llama", "hidden_act": "silu", "hidden_size": 256,
            "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 8,
            "num_key_value_heads": 4, "vocab_size": 1024, "max_position_embeddings": 64,
            "tie_word_embeddings": False}

HF_CASES: list[tuple[str, Content, tuple[str, ...]]] = [
    ("heads do not divide width", {**HF_GPT, "n_head": 5},
     ("hidden_size 64 is not divisible by num_heads 5",)),
    ("zero heads", {**HF_GPT, "n_head": 0}, ("n_head must be a positive integer, got 0",)),
    ("zero vocab", {**HF_GPT, "vocab_size": 0}, ("vocab_size must be a positive integer, got 0",)),
    ("zero context", {**HF_GPT, "n_positions": 0}, ("n_positions must be a positive integer, got 0",)),
    ("layers float", {**HF_GPT, "n_layer": 2.0}, ("n_layer must be a positive integer, got 2.0",)),
    ("layers bool", {**HF_GPT, "n_layer": True}, ("n_layer must be a positive integer, got True",)),
    ("layers null", {**HF_GPT, "n_layer": None}, ("n_layer must be a positive integer, got None",)),
    ("vocab missing", {k: v for k, v in HF_GPT.items() if k != "vocab_size"},
     ("GPT-2 style config is missing vocab_size",)),
    ("n_inner negative", {**HF_GPT, "n_inner": -1},
     ("n_inner must be a positive integer or null, got -1",)),
    ("n_inner a string", {**HF_GPT, "n_inner": "x"},
     ("n_inner must be a positive integer or null, got 'x'",)),
    ("absurd layer count", {**HF_GPT, "n_layer": 10**9},
     ("num_layers 1,000,000,000 is above meshmorph's limit of 4,096",)),
    ("absurd width", {**HF_GPT, "n_embd": 10**12, "n_head": 1},
     ("hidden_size 1,000,000,000,000 is above meshmorph's limit",)),
    ("absurd vocab", {**HF_GPT, "vocab_size": 10**15}, ("vocab_size 1,000,000,000,000,000 is above",)),
    ("absurd context", {**HF_GPT, "n_positions": 10**12},
     ("seq_len 1,000,000,000,000 is above meshmorph's limit",)),
    ("kv heads do not divide heads", {**HF_LLAMA, "num_key_value_heads": 3},
     ("num_key_value_heads 3 must be a positive divisor of num_attention_heads 8",)),
    ("kv heads zero", {**HF_LLAMA, "num_key_value_heads": 0},
     ("num_key_value_heads 0 must be a positive divisor",)),
    ("kv heads above heads", {**HF_LLAMA, "num_key_value_heads": 16},
     ("num_key_value_heads 16 must be a positive divisor",)),
    ("kv heads a string", {**HF_LLAMA, "num_key_value_heads": "4"},
     ("num_key_value_heads '4' must be a positive divisor",)),
    ("ffn zero", {**HF_LLAMA, "intermediate_size": 0},
     ("intermediate_size must be a positive integer, got 0",)),
    ("ffn a string", {**HF_LLAMA, "intermediate_size": "big"},
     ("intermediate_size must be a positive integer, got 'big'",)),
    ("ffn missing", {k: v for k, v in HF_LLAMA.items() if k != "intermediate_size"},
     ("Llama style config is missing intermediate_size",)),
    ("activation not SwiGLU", {**HF_LLAMA, "hidden_act": "relu6"},
     ("hidden_act 'relu6' is not a SwiGLU activation",)),
    ("activation a number", {**HF_LLAMA, "hidden_act": 3}, ("hidden_act 3 is not a SwiGLU activation",)),
    ("attention implementation unknown", {**HF_LLAMA, "attn_implementation": "magic"},
     ("attn_implementation 'magic' is not one of eager, sdpa",)),
    ("dropout one", {**HF_LLAMA, "attention_dropout": 1.0},
     ("attention_dropout must be a probability in [0, 1), got 1.0",)),
    ("dropout negative", {**HF_LLAMA, "attention_dropout": -0.1},
     ("attention_dropout must be a probability in [0, 1), got -0.1",)),
    ("dropout NaN", _json_with(HF_LLAMA, '"model_type": "llama"',
                               '"model_type": "llama", "attention_dropout": NaN'),
     ("attention_dropout must be a probability in [0, 1), got nan",)),
    ("dropout a string", {**HF_LLAMA, "attention_dropout": "0.1"},
     ("attention_dropout must be a probability in [0, 1), got '0.1'",)),
    ("resid dropout of GPT-2", {**HF_GPT, "resid_pdrop": 2},
     ("resid_pdrop must be a probability in [0, 1), got 2",)),
    ("tying a number", {**HF_LLAMA, "tie_word_embeddings": 1},
     ("tie_word_embeddings must be true or false, got 1",)),
    ("utf-16 text", json.dumps(HF_GPT).encode("utf-16"), ("is not text (binary data)",)),
    ("malformed", '{"n_layer": 2,', ("is not valid JSON", "catalog name")),
]


@_table(HF_CASES)
def test_bad_hf_config_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture, content: Content,
                                  needles: tuple[str, ...]) -> None:
    config = write(tmp_path / "config.json", content)
    refused(capsys, ["estimate", "--model", str(config), "--cluster", "h100:1x8", "--tp", "1",
                     "--pp", "1", "--dp", "8"], *needles)


@pytest.mark.parametrize("kind", ["missing", "folder"])
def test_a_hf_config_that_is_missing_or_a_folder_is_named(tmp_path: Path, kind: str,
                                                         capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "config.json" if kind == "missing" else tmp_path
    refused(capsys, ["estimate", "--model", str(path), "--cluster", "h100:1x8", "--tp", "1", "--pp",
                     "1", "--dp", "8"],
            f"model config {path} " + ("does not exist" if kind == "missing" else "is a folder"),
            "pass the path of a Hugging Face config.json")


# --- GPU files (meshmorph gpus --gpus) ---------------------------------------------------------
NEW_GPU = "[gpus.x]\nmemory_gib = 80\nhbm_gbps = 1000\npeak_tflops = {bf16 = 100}\n"

GPU_CASES: list[tuple[str, Content, tuple[str, ...]]] = [
    ("empty", "", ("defines no GPU or link", "leave out --gpus")),
    ("binary", BINARY, ("is not text (binary data) and so is not valid TOML", "[gpus.NAME]")),
    ("unclosed table", "[gpus.h100\n", ("is not valid TOML", "[gpus.NAME]")),
    ("unknown table", "[gpu.x]\nmemory_gib = 1\n", ("unknown table 'gpu'",)),
    ("new GPU incomplete", "[gpus.x]\nmemory_gib = 80\n", ("new GPU 'x' needs hbm_gbps, peak_tflops",)),
    ("new GPU memory 0", NEW_GPU.replace("memory_gib = 80", "memory_gib = 0"),
     ("GPU 'x': memory_gib must be a finite number > 0, got 0.0",)),
    ("new GPU without dtypes", NEW_GPU.replace("{bf16 = 100}", "{}"),
     ("peak_tflops in [gpus.x] must be a table such as",)),
    ("memory nan", "[gpus.h100]\nmemory_gib = nan\n", ("memory_gib must be a number >= 0, got nan",)),
    ("memory negative", "[gpus.h100]\nmemory_gib = -80\n", ("memory_gib must be a number >= 0, got -80",)),
    ("memory a string", '[gpus.h100]\nmemory_gib = "80"\n',
     ("memory_gib must be a number >= 0, got '80'",)),
    ("memory bool", "[gpus.h100]\nmemory_gib = true\n", ("memory_gib must be a number >= 0, got True",)),
    ("hbm inf", "[gpus.h100]\nhbm_gbps = inf\n", ("hbm_gbps must be a number >= 0, got inf",)),
    ("hbm zero", "[gpus.h100]\nhbm_gbps = 0\n", ("GPU 'h100': hbm_gbps must be a finite number > 0",)),
    ("peak negative", "[gpus.h100]\npeak_tflops = {bf16 = -1}\n",
     ("peak_tflops.bf16 must be a number >= 0, got -1",)),
    ("peak zero", "[gpus.h100]\npeak_tflops = {bf16 = 0}\n",
     ("peak_tflops.bf16 must be a finite number > 0, got 0.0", "leave out a dtype")),
    ("peak not a table", "[gpus.h100]\npeak_tflops = 5\n", ("must be a table such as",)),
    ("peak a string", '[gpus.h100]\npeak_tflops = {bf16 = "x"}\n',
     ("peak_tflops.bf16 must be a number >= 0, got 'x'",)),
    ("unknown key", "[gpus.h100]\ncolor = 1\n",
     ("unknown key 'color' in [gpus.h100]", "valid keys: description")),
    ("price negative", "[gpus.h100]\nprice_per_hour = -2\n",
     ("price_per_hour must be a number >= 0, got -2",)),
    ("price a string", '[gpus.h100]\nprice_per_hour = "2"\n',
     ("price_per_hour must be a number >= 0, got '2'",)),
    ("spot price nan", "[gpus.h100]\nspot_price_per_hour = nan\n",
     ("spot_price_per_hour must be a number >= 0, got nan",)),
    ("price date a number", "[gpus.h100]\nprice_date = 2024\n",
     ("price_date in [gpus.h100] must be a string, got 2024",)),
    ("description a number", "[gpus.h100]\ndescription = 5\n",
     ("description in [gpus.h100] must be a string, got 5",)),
    ("intra link unknown", '[gpus.h100]\nintra_node_link = "warp"\n',
     ("unknown intra_node_link 'warp' in [gpus.h100]", "define it under [links.NAME]")),
    ("inter link a number", "[gpus.h100]\ninter_node_link = 3\n",
     ("inter_node_link in [gpus.h100] must be a string, got 3",)),
    ("sm count negative", "[gpus.h100]\nsm_count = -1\n", ("sm_count must be a number >= 0, got -1",)),
    ("gpus not a table", "gpus = 3\n", ("gpus must be a table of [gpus.NAME] tables, got 3",)),
    ("a GPU entry not a table", "[gpus]\nh100 = 3\n", ("[gpus.h100] must be a table, got 3",)),
    ("links not a table", "links = 3\n", ("links must be a table of [links.NAME] tables, got 3",)),
    ("a link entry not a table", "[links]\nx = 3\n",
     ("[links.x] takes bandwidth_gbps and latency_us only",)),
    ("link unknown key", "[links.x]\nbandwidth_gbps = 1\nlatency_us = 1\nmtu = 9000\n",
     ("[links.x] takes bandwidth_gbps and latency_us only",)),
    ("new link incomplete", "[links.x]\nbandwidth_gbps = 1\n",
     ("new link 'x' needs bandwidth_gbps and latency_us",)),
    ("link bandwidth zero", "[links.nvlink4]\nbandwidth_gbps = 0\n",
     ("link 'nvlink4': bandwidth_gbps must be a finite number > 0, got 0.0",)),
    ("link bandwidth negative", "[links.nvlink4]\nbandwidth_gbps = -5\n",
     ("bandwidth_gbps must be a number >= 0, got -5",)),
    ("link latency nan", "[links.nvlink4]\nlatency_us = nan\n",
     ("latency_us must be a number >= 0, got nan",)),
    ("link bandwidth a string", '[links.nvlink4]\nbandwidth_gbps = "fast"\n',
     ("bandwidth_gbps must be a number >= 0, got 'fast'",)),
    # figures far beyond any hardware: typos that would make every estimate wrong
    ("absurd memory", "[gpus.h100]\nmemory_gib = 1e300\n",
     ("GPU 'h100': memory_gib = 1e+300 is above 1,000,000 GiB, far beyond any hardware",
      "give the data-sheet figure in GiB")),
    ("absurd memory of a new GPU", NEW_GPU.replace("memory_gib = 80", "memory_gib = 80000000"),
     ("GPU 'x': memory_gib = 8e+07 is above 1,000,000 GiB",)),
    ("absurd hbm", "[gpus.h100]\nhbm_gbps = 3.35e12\n",
     ("GPU 'h100': hbm_gbps = 3.35e+12 is above 100,000,000 GB/s",)),
    ("absurd peak", "[gpus.h100]\npeak_tflops = {bf16 = 989e12}\n",
     ("GPU 'h100': peak_tflops.bf16 = 9.89e+14 is above 10,000,000 TFLOP/s",
      "give the data-sheet figure in TFLOP/s")),
    ("absurd sm count", "[gpus.h100]\nsm_count = 1e300\n",
     ("GPU 'h100': sm_count = 1e+300 is above 10,000,000 cores",)),
    ("absurd link bandwidth", "[links.nvlink4]\nbandwidth_gbps = 450e9\n",
     ("link 'nvlink4': bandwidth_gbps = 4.5e+11 is above 10,000,000 GB/s",)),
    ("absurd link latency", "[links.x]\nbandwidth_gbps = 1\nlatency_us = 1e300\n",
     ("link 'x': latency_us = 1e+300 is above 1,000,000 us",)),
]


@_table(GPU_CASES)
def test_bad_gpu_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture, content: Content,
                                 needles: tuple[str, ...]) -> None:
    gpus = write(tmp_path / "gpus.toml", content)
    refused(capsys, ["gpus", "--gpus", str(gpus), "--json", str(tmp_path / "out.json")], *needles)
    assert not (tmp_path / "out.json").exists()


@pytest.mark.parametrize("kind", ["missing", "folder"])
def test_a_gpu_file_that_is_missing_or_a_folder_is_named(tmp_path: Path, kind: str,
                                                         capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "gpus.toml" if kind == "missing" else tmp_path
    refused(capsys, ["gpus", "--gpus", str(path)],
            f"GPU file {path} " + ("does not exist" if kind == "missing" else "is a folder"),
            "[gpus.NAME]")


# --- cloud catalogs (meshmorph simulate --catalog) ---------------------------------------------
INSTANCE = ('[[instances]]\nname = "i"\ncloud = "other"\nprovider = "gcp-spot"\ngpu = "h100"\n'
            'gpus = 8\ninterconnect = "nvlink4"\nnetwork = "ib-hdr"\nspot_usd_per_h = 10.0\n'
            'region = "r"\ndate = "2026-11"\nsource = "s"\n')
ZONE = '[[zones]]\nname = "z-1a"\nprovider = "gcp-spot"\n'
PRICE = ('[[prices]]\ninstance = "gcp-h100-x8"\nregion = "r"\nspot_usd_per_h = 1.0\n'
         'date = "2026-11"\nsource = "s"\n')


def _instance(old: str, new: str) -> str:
    assert old in INSTANCE
    return INSTANCE.replace(old, new)


CATALOG_CASES: list[tuple[str, Content, tuple[str, ...]]] = [
    ("binary", BINARY, ("is not text (binary data) and so is not valid TOML", "my_zones.toml")),
    ("utf-16 text", INSTANCE.encode("utf-16"), ("is not text (binary data)",)),
    ("unclosed table", "[providers.x\n", ("is not valid TOML", "my_zones.toml")),
    ("unknown table", "foo = 3\n", ("unknown table 'foo'", "a catalog holds [providers.NAME]")),
    ("providers a number", "providers = 3\n", ("providers must be [providers.NAME] tables, got 3",)),
    ("a provider not a table", "[providers]\nx = 3\n", ("providers must be [providers.NAME] tables",)),
    ("provider unknown key", "[providers.x]\nnotice_s = 30\ncolor = 1\n",
     ("[providers.x]: unknown key 'color'", "valid keys")),
    ("provider without notice", "[providers.x]\nrate_per_h = 0.1\n",
     ("[providers.x]: missing notice_s",)),
    ("provider hazard unknown", '[providers.x]\nnotice_s = 30\nhazard = "weibull"\n',
     ("unknown hazard 'weibull'", "use 'fitted'")),
    ("provider cloud unknown", '[providers.x]\nnotice_s = 30\ncloud = "mars"\n',
     ("cloud 'mars' is not one of GCP, AWS, Azure, other",)),
    ("provider notice negative", "[providers.x]\nnotice_s = -30\n",
     ("notice_s must be a finite number >= 0, got -30",)),
    ("provider notice a string", '[providers.x]\nnotice_s = "30"\n',
     ("[providers.x]: notice_s must be float, got '30'",)),
    ("provider rate nan", "[providers.x]\nnotice_s = 30\nrate_per_h = nan\n",
     ("rate_per_h must be a finite number >= 0, got nan",)),
    ("provider rate inf", "[providers.x]\nnotice_s = 30\nrate_per_h = inf\n",
     ("rate_per_h must be a finite number >= 0, got inf",)),
    ("provider runtime cap zero", "[providers.x]\nnotice_s = 30\nmax_runtime_h = 0\n",
     ("max_runtime_h must be > 0 hours, got 0", "leave it out for no cap")),
    ("instances a number", "instances = 3\n", ("instances must be [[instances]] tables, got 3",)),
    ("an instance a number", "instances = [3]\n", ("instances must be [[instances]] tables",)),
    ("instance incomplete", '[[instances]]\nname = "i"\n',
     ("[[instances]] #1: missing cloud, provider, gpu",)),
    ("instance GPU unknown", _instance('"h100"', '"h900"'),
     ("[[instances]] #1: unknown gpu 'h900'", "meshmorph gpus --gpus FILE")),
    ("instance link unknown", _instance('"nvlink4"', '"warp"'),
     ("[[instances]] #1: unknown link 'warp'",)),
    ("instance provider unknown", _instance('"gcp-spot"', '"nope"'),
     ("[[instances]] #1: unknown provider 'nope'",)),
    ("instance of no GPU", _instance("gpus = 8", "gpus = 0"),
     ("gpus must be at least 1 GPU per instance, got 0",)),
    ("instance GPUs a string", _instance("gpus = 8", 'gpus = "8"'), ("gpus must be int, got '8'",)),
    ("instance GPUs fractional", _instance("gpus = 8", "gpus = 8.5"), ("gpus must be int, got 8.5",)),
    ("instance price negative", _instance("spot_usd_per_h = 10.0", "spot_usd_per_h = -10.0"),
     ("spot_usd_per_h must be a finite number >= 0, got -10.0",)),
    ("instance price a string", _instance("spot_usd_per_h = 10.0", 'spot_usd_per_h = "10"'),
     ("spot_usd_per_h must be float | None, got '10'",)),
    ("instance unknown key", INSTANCE + "color = 1\n", ("[[instances]] #1: unknown key 'color'",)),
    ("instance name a number", _instance('name = "i"', "name = 1"), ("name must be str, got 1",)),
    ("price for an unknown instance", PRICE.replace("gcp-h100-x8", "nope"),
     ("a price for unknown instance 'nope'",)),
    ("price incomplete", '[[prices]]\ninstance = "nope"\n', ("[[prices]] #1: missing region, date",)),
    ("price a number", "prices = [1]\n", ("prices must be [[prices]] tables, got [1]",)),
    ("price nan", PRICE.replace("spot_usd_per_h = 1.0", "spot_usd_per_h = nan"),
     ("[[prices]] #1: spot_usd_per_h must be a finite number >= 0, got nan",)),
    ("zone share zero", ZONE + "share_available = 0\n",
     ("zone z-1a: share_available must be in (0, 1], got 0",)),
    ("zone share above one", ZONE + "share_available = 2\n",
     ("share_available must be in (0, 1], got 2",)),
    ("zone share nan", ZONE + "share_available = nan\n",
     ("share_available must be a finite number >= 0, got nan",)),
    ("zone share a string", ZONE + 'share_available = "0.5"\n',
     ("share_available must be float, got '0.5'",)),
    ("zone uptime zero", ZONE + "mean_up_h = 0\n", ("zone z-1a: mean_up_h must be > 0 hours, got 0",)),
    ("zone provider unknown", ZONE.replace('"gcp-spot"', '"nope"'),
     ("zone z-1a: unknown provider 'nope'",)),
    ("zone without a name", '[[zones]]\nprovider = "gcp-spot"\n', ("[[zones]] #1: missing name",)),
    ("zone unknown key", ZONE + "color = 1\n", ("[[zones]] #1: unknown key 'color'",)),
    ("zone preemptions negative", ZONE + "preemptions_per_h = -1\n",
     ("preemptions_per_h must be a finite number >= 0, got -1",)),
    ("zone name a number", ZONE.replace('name = "z-1a"', "name = 3"), ("name must be str, got 3",)),
    ("zones a number", "zones = 3\n", ("zones must be [[zones]] tables, got 3",)),
]


@_table(CATALOG_CASES)
def test_bad_catalog_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture,
                                     content: Content, needles: tuple[str, ...]) -> None:
    catalog = write(tmp_path / "zones.toml", content)
    refused(capsys, ["simulate", "--model", "gpt3-125m", "--tokens", "1e9", "--cluster", "h100:1x8",
                     "--spot", "--runs", "2", "--catalog", str(catalog), "--json",
                     str(tmp_path / "out.json")], *needles)
    assert not (tmp_path / "out.json").exists()


@pytest.mark.parametrize("kind", ["missing", "folder"])
def test_a_catalog_file_that_is_missing_or_a_folder_is_named(
        tmp_path: Path, kind: str, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "zones.toml" if kind == "missing" else tmp_path
    refused(capsys, ["advise", "--model", "gpt3-125m", "--tokens", "1e9", "--catalog", str(path)],
            f"catalog file {path} " + ("does not exist" if kind == "missing" else "is a folder"),
            "examples/my_zones.toml")


# --- profiles (meshmorph estimate --profile) ---------------------------------------------------
PROFILE_CASES: list[tuple[str, Content, tuple[str, ...]]] = [
    ("empty", "", ("is empty", "meshmorph profile --out FILE")),
    ("binary", BINARY, ("is not text (binary data) and so is not valid JSON",
                        "meshmorph profile --out FILE")),
    ("a list", "[]", ("must hold a JSON object, got list",)),
    ("unknown key", {"speed": 1}, ("has unknown keys ['speed']", "re-run meshmorph profile")),
    ("efficiency a string", {"matmul_efficiency": "x"},
     ("matmul_efficiency must be a JSON object, got 'x'", "re-run meshmorph profile")),
    ("efficiency NaN", '{"matmul_efficiency": {"h100": NaN}}',
     ("matmul_efficiency['h100'] must be a finite number > 0, got nan",)),
    ("efficiency zero", {"matmul_efficiency": {"h100": 0}},
     ("matmul_efficiency['h100'] must be a finite number > 0, got 0",)),
    ("efficiency negative", {"matmul_efficiency": {"h100": -0.5}},
     ("matmul_efficiency['h100'] must be a finite number > 0, got -0.5",)),
    ("bandwidth zero", {"link_bandwidth_gbps": {"nvlink4": 0}},
     ("link_bandwidth_gbps['nvlink4'] must be a finite number > 0, got 0",)),
    ("bandwidth negative", {"link_bandwidth_gbps": {"nvlink4": -1}},
     ("link_bandwidth_gbps['nvlink4'] must be a finite number > 0, got -1",)),
    ("bandwidth Infinity", '{"link_bandwidth_gbps": {"nvlink4": Infinity}}',
     ("link_bandwidth_gbps['nvlink4'] must be a finite number > 0, got inf",)),
    ("latency negative", {"link_latency_us": {"nvlink4": -1}},
     ("link_latency_us['nvlink4'] must be a finite number >= 0, got -1",)),
    ("latency a string", {"link_latency_us": {"nvlink4": "x"}},
     ("link_latency_us['nvlink4'] must be a finite number >= 0, got 'x'",)),
    ("GEMM rate negative", {"gemm_flops_per_s": {"bf16:1x1x1": -1}},
     ("gemm_flops_per_s['bf16:1x1x1'] must be a finite number > 0, got -1",)),
    ("collective alpha a string", {"collectives": {"all_reduce/8": {"alpha_s": "x"}}},
     ("collectives['all_reduce/8'].alpha_s must be a finite number >= 0, got 'x'",)),
    ("collective without beta", {"collectives": {"all_reduce/8": {"alpha_s": 1e-5}}},
     ("collectives['all_reduce/8'].beta_s_per_byte must be a finite number > 0, got None",)),
    ("collective row empty", {"collectives": {"all_reduce/8": {}}},
     ("collectives['all_reduce/8'].alpha_s must be a finite number >= 0, got None",)),
    ("collective row a number", {"collectives": {"all_reduce/8": 3}},
     ("collectives['all_reduce/8'] must be a JSON object, got 3",)),
    ("collectives a list", {"collectives": [1]}, ("collectives must be a JSON object, got [1]",)),
    ("layer time negative", {"layer_times": {"k": {"fwd_s": -1, "bwd_s": 1}}},
     ("layer_times['k'].fwd_s must be a finite number >= 0, got -1",)),
    ("layer time without backward", {"layer_times": {"k": {"fwd_s": 1}}},
     ("layer_times['k'].bwd_s must be a finite number >= 0, got None",)),
    ("layer times a number", {"layer_times": 3}, ("layer_times must be a JSON object, got 3",)),
    ("optimizer time negative", {"optimizer_s_per_param": -1},
     ("optimizer_s_per_param must be a finite number >= 0, got -1",)),
    ("optimizer time a string", {"optimizer_s_per_param": "x"},
     ("optimizer_s_per_param must be a finite number >= 0, got 'x'",)),
    ("optimizer fixed time Infinity", '{"optimizer_fixed_s": Infinity}',
     ("optimizer_fixed_s must be a finite number >= 0, got inf",)),
    ("processes zero", {"processes": 0}, ("processes must be a whole number >= 1, got 0",)),
    ("processes a string", {"processes": "x"}, ("processes must be a whole number >= 1, got 'x'",)),
    ("cores negative", {"cores": -1}, ("cores must be a whole number >= 0, got -1",)),
    ("load average NaN", '{"load_avg": NaN}', ("load_avg must be a finite number >= 0, got nan",)),
    ("source a number", {"source": 3}, ("source must be a string, got 3",)),
]


@_table(PROFILE_CASES)
def test_bad_profile_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture, content: Content,
                                needles: tuple[str, ...]) -> None:
    profile = write(tmp_path / "profile.json", content)
    refused(capsys, ["estimate", "--model", "gpt3-125m", "--cluster", "h100:1x8", "--tp", "1",
                     "--pp", "1", "--dp", "8", "--profile", str(profile)], *needles)


@pytest.mark.parametrize("command", ["plan", "estimate", "reshape"])
def test_a_profile_that_is_a_folder_is_named_as_one(tmp_path: Path, command: str,
                                                    capsys: pytest.CaptureFixture) -> None:
    args = {"plan": ["plan", "--model", "gpt3-125m", "--cluster", "h100:1x8", "--global-batch", "8"],
            "estimate": ["estimate", "--model", "gpt3-125m", "--cluster", "h100:1x8", "--tp", "1",
                         "--pp", "1", "--dp", "8"],
            "reshape": ["reshape", "--from", str(PLANS / "reshape-tp2-pp2.json"), "--to",
                        str(PLANS / "reshape-zero3-dp4.json")]}[command]
    refused(capsys, [*args, "--profile", str(tmp_path)], f"profile file {tmp_path} is a folder",
            "meshmorph profile --out FILE")


# --- spot traces (meshmorph simulate --trace) --------------------------------------------------
TRACE = {"metadata": {"gap_seconds": 60, "zone": "us-central1-a"}, "data": [0, 1, 0, 0]}
COUNTS = {"kind": "counts", "tick_s": 60, "segments": [{"rounds": {"z": "11"}}], "gpu": "h100",
          "provider": "gcp-spot", "source": "s", "about": "a", "requested_gpus": 8}
PROBES = {"kind": "probes", "tick_times_s": [0, 60], "zones": {"a": "11"}, "gpu": "l4",
          "provider": "aws-spot", "source": "s", "about": "a"}


def _meta(**meta: Any) -> dict[str, Any]:
    return {**TRACE, "metadata": {"gap_seconds": 60, **meta}}


TRACE_CASES: list[tuple[str, Content, tuple[str, ...]]] = [
    ("empty", "", ("(file): not valid JSON",)),
    ("binary", BINARY, ("(file): not valid JSON",)),
    ("a list", "[1]", ("(top level): must be a JSON object with 'metadata' and 'data'",)),
    ("no metadata", {"data": [0]}, ("metadata: missing or not an object",)),
    ("metadata a number", {"metadata": 3, "data": [0]}, ("metadata: missing or not an object",)),
    ("no tick", {"metadata": {}, "data": [0]}, ("metadata.gap_seconds: missing",)),
    ("tick zero", {**TRACE, "metadata": {"gap_seconds": 0}},
     ("metadata.gap_seconds: must be a finite number > 0, got 0",)),
    ("tick negative", {**TRACE, "metadata": {"gap_seconds": -60}},
     ("metadata.gap_seconds: must be a finite number > 0, got -60",)),
    ("tick a string", {**TRACE, "metadata": {"gap_seconds": "60"}},
     ("metadata.gap_seconds: must be a finite number > 0, got '60'",)),
    ("tick NaN", '{"metadata": {"gap_seconds": NaN}, "data": [0]}',
     ("metadata.gap_seconds: must be a finite number > 0, got nan",)),
    ("no ticks", {**TRACE, "data": []}, ("data: missing or empty",)),
    ("tick state 2", {**TRACE, "data": [0, 2]}, ("data[1]: must be 0 (capacity) or 1 (none), got 2",)),
    ("tick state fractional", {**TRACE, "data": [0, 0.5]}, ("data[1]: must be 0 (capacity) or 1",)),
    ("ticks a string", {**TRACE, "data": "0101"}, ("data: missing or empty; give one 0/1 per tick",)),
    ("zone a number", _meta(zone=3), ("metadata.zone: must be a non-empty string, got 3",)),
    ("zone empty", _meta(zone=""), ("metadata.zone: must be a non-empty string, got ''",)),
    ("price negative", {**TRACE, "prices": [-1, 2]}, ("prices[]: must be a finite number > 0, got -1",)),
    ("price_info a number", _meta(price_info=3), ("metadata.price_info: must be an object",)),
    ("price_info price negative", _meta(price_info={"price": -1}),
     ("metadata.price_info.price: must be a finite number > 0, got -1",)),
    ("price_info on-demand a string", _meta(price_info={"on_demand_price": "x"}),
     ("metadata.price_info.on_demand_price: must be a finite number > 0, got 'x'",)),
    ("gap index a string", _meta(gap_filled={"gap_start_index": "a", "gap_end_index": 2}),
     ("metadata.gap_filled: needs whole tick indices", "got 'a' and 2")),
    ("gap reversed past the end", _meta(gap_filled={"gap_start_index": 5, "gap_end_index": 2}),
     ("metadata.gap_filled: needs whole tick indices 0 <= gap_start_index <= gap_end_index < 4",)),
    ("gap past the end", _meta(gap_filled={"gap_start_index": 1, "gap_end_index": 9}),
     ("gap_end_index < 4, got 1 and 9",)),
    ("availability empty", {"availability": {}}, ("availability: must map trace names to entries",)),
    ("availability a list", {"availability": [1]}, ("availability: must map trace names to entries",)),
    ("kind unknown", {"availability": {"x": {"kind": "magic"}}},
     ("kind: 'magic' is not a replayable trace; use one of counts, probes",)),
    ("counts incomplete", {"availability": {"x": {"kind": "counts"}}},
     ("segments: missing or malformed",)),
    ("probes incomplete", {"availability": {"x": {"kind": "probes"}}},
     ("tick_times_s: missing or malformed",)),
    ("probes of one tick", {"availability": {"x": {**PROBES, "tick_times_s": [0]}}},
     ("tick_times_s: needs at least two increasing times, got [0]",)),
    ("probes going back in time", {"availability": {"x": {**PROBES, "tick_times_s": [60, 0]}}},
     ("tick_times_s: needs at least two increasing times",)),
    ("counts tick zero", {"availability": {"x": {**COUNTS, "tick_s": 0}}},
     ("tick_s: must be a finite number > 0, got 0",)),
    ("counts not base-17", {"availability": {"x": {**COUNTS, "segments": [{"rounds": {"z": "!!"}}]}}},
     ("missing or malformed",)),
]


@_table(TRACE_CASES)
def test_bad_trace_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture, content: Content,
                              needles: tuple[str, ...]) -> None:
    trace = write(tmp_path / "trace.json", content)
    refused(capsys, ["simulate", "--model", "gpt3-125m", "--tokens", "1e9", "--cluster", "h100:1x8",
                     "--spot", "--runs", "2", "--trace", str(trace), "--png",
                     str(tmp_path / "out.png")], f"trace {trace}", *needles)
    assert not (tmp_path / "out.png").exists()


@pytest.mark.parametrize(("name", "needle"), [
    ("missing.json", "does not exist; give a trace file, a folder of */full.json"),
    ("folder", "holds no */full.json"),
])
def test_a_trace_that_is_missing_or_an_empty_folder_is_named(
        tmp_path: Path, name: str, needle: str, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "folder").mkdir()
    refused(capsys, ["simulate", "--model", "gpt3-125m", "--tokens", "1e9", "--cluster", "h100:1x8",
                     "--spot", "--trace", str(tmp_path / name)], needle)


# --- measured pipeline traces (meshmorph timeline --compare RUN_DIR) ---------------------------
ACTIONS = [{"ph": "X", "ts": t * 10, "dur": 10,
            "args": {"rank": 0, "kind": kind, "stage": 0, "microbatch": 0}}
           for t, kind in enumerate("FB")]
RUN_TRACE = {"traceEvents": ACTIONS, "schedule": "1f1b", "pp": 1, "microbatches": 1, "vpp": 1,
             "steps": 1}


def _action(**args: Any) -> dict[str, Any]:
    return {**RUN_TRACE, "traceEvents": [{**ACTIONS[0], "args": {**ACTIONS[0]["args"], **args}}]}


RUN_TRACE_CASES: list[tuple[str, Content, tuple[str, ...]]] = [
    ("empty", "", ("is empty", "meshmorph run --trace")),
    ("binary", BINARY, ("is not text (binary data)", "meshmorph run --trace")),
    ("a list", "[]", ("must hold a JSON object, got list",)),
    ("no events", {"schedule": "1f1b"}, ("holds no 'traceEvents' list; it is not a Chrome trace",)),
    ("events an object", {"traceEvents": {}}, ("holds no 'traceEvents' list",)),
    ("no pipeline action", {"traceEvents": [{"ph": "M"}]}, ("holds no pipeline actions",)),
    ("action without a kind", {**RUN_TRACE, "traceEvents": [
        {"ph": "X", "ts": 0, "dur": 1, "args": {"rank": 0, "stage": 0, "microbatch": 0}}]},
     ("holds a pipeline action without a whole rank", "KeyError")),
    ("action rank a word", _action(rank="zero"), ("holds a pipeline action without a whole rank",)),
    ("action without a start", {**RUN_TRACE, "traceEvents": [
        {"ph": "X", "dur": 1, "args": ACTIONS[0]["args"]}]}, ("without a whole rank",)),
    ("event a number", {**RUN_TRACE, "traceEvents": [3]}, ("without a whole rank",)),
    ("no schedule", {**RUN_TRACE, "schedule": None}, ("does not name its schedule",)),
    ("no pp", {k: v for k, v in RUN_TRACE.items() if k != "pp"},
     ("pp must be a whole number >= 1, got None",)),
    ("pp a string", {**RUN_TRACE, "pp": "1"}, ("pp must be a whole number >= 1, got '1'",)),
    ("micro-batches zero", {**RUN_TRACE, "microbatches": 0},
     ("microbatches must be a whole number >= 1, got 0",)),
    ("vpp negative", {**RUN_TRACE, "vpp": -1}, ("vpp must be a whole number >= 1, got -1",)),
    ("steps fractional", {**RUN_TRACE, "steps": 1.5}, ("steps must be a whole number >= 1, got 1.5",)),
    ("absurd micro-batch count", {**RUN_TRACE, "microbatches": 10**12},
     ("(stage, micro-batch) pairs is above the 65,536 a readable chart takes",)),
]


@_table(RUN_TRACE_CASES)
def test_bad_measured_trace_is_refused_by_timeline_compare(
        tmp_path: Path, capsys: pytest.CaptureFixture, content: Content,
        needles: tuple[str, ...]) -> None:
    write(tmp_path / "run" / "trace.json", content)
    refused(capsys, ["timeline", "--compare", str(tmp_path / "run"), "--png",
                     str(tmp_path / "out.png")], *needles)
    assert not (tmp_path / "out.png").exists()


def test_the_measured_trace_of_the_table_above_is_itself_accepted(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    write(tmp_path / "run" / "trace.json", RUN_TRACE)
    assert cli_main(["timeline", "--compare", str(tmp_path / "run")]) == 0
    assert "measured 0.020 ms per step" in capsys.readouterr().out
