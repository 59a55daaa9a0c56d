"""tandem against SGLang's real API: the launcher's flags and api.py's fields, checked by name.

tests/fixtures/sglang_api.json holds names recorded from SGLang's own source by
scripts/record_sglang_api.py (tests/fixtures/README.md). SGLang cannot run here, so these tests
are what keeps `backend: sglang` honest on a CPU machine: every flag the launcher passes is a real
`sglang.launch_server` flag, every request field tandem sends is one SGLang accepts, and every
response field tandem reads is one SGLang returns.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import stat
import sys
import typing
from pathlib import Path

import pytest
import yaml

from configs.fields import SGLANG_FLAGS_SET_BY_TANDEM
from configs.sections import EngineConfig, ModelConfig
from infra.engines import api
from infra.engines import sglang as launcher
from infra.engines.process import EngineProcess, EngineStartError

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = json.loads((ROOT / "tests/fixtures/sglang_api.json").read_text())
FLAGS = FIXTURE["server_args"]["cli_flags"]
STRUCTS = FIXTURE["structs"]
CONTRACT = FIXTURE["http_contract"]["structs"]
SECRET = "sk-tandem-test-7f3a9c"


def fields(model) -> set[str]:
    return set(model.model_fields)


def route(method: str, path: str) -> dict:
    found = [r for r in FIXTURE["routes"]["routes"] if r["path"] == path and method in r["methods"]]
    assert found, f"SGLang {FIXTURE['sglang_version']} has no {method} {path}"
    return found[0]


def engine_config(**overrides) -> EngineConfig:
    return EngineConfig(**({"backend": "sglang", "tp_size": 2, "mem_fraction_static": 0.7} | overrides))


def check_flags(args: list[str]) -> list[str]:
    """Assert every --flag is a real ServerArgs flag given a value iff it takes one; return them."""
    assert args[:3] == [sys.executable, "-m", FIXTURE["server_args"]["launcher_module"]]
    flags = [a for a in args[3:] if a.startswith("--")]
    for i, arg in enumerate(args[3:], start=3):
        if not arg.startswith("--"):
            assert args[i - 1].startswith("--"), f"stray value {arg!r}"
            continue
        assert arg in FLAGS, f"{arg} is not a flag of sglang.launch_server {FIXTURE['sglang_version']}"
        assert not FLAGS[arg].get("deprecated"), f"{arg} is deprecated in SGLang"
        value_follows = i + 1 < len(args) and not args[i + 1].startswith("--")
        assert FLAGS[arg]["takes_value"] == value_follows, f"{arg}: takes_value={FLAGS[arg]['takes_value']}"
    assert len(flags) == len(set(flags)), "a flag is given twice"
    return flags


# -- (a) the launcher's command line ---------------------------------------------------------


@pytest.mark.parametrize("with_key", [False, True])
@pytest.mark.parametrize("config_file", [None, Path("/tmp/x/.engine.secret.yaml")])
def test_every_launcher_flag_is_a_real_sglang_flag(with_key: bool, config_file: Path | None):
    engine = engine_config(api_key=SECRET if with_key else None)
    args = launcher.sglang_server_args(
        engine, "/snap/v00000003", 30001, "3", 17, dtype="float32", config_file=config_file, nccl_port=24000
    )
    flags = check_flags(args)
    expected = ["--model-path", "--host", "--port", "--tp-size", "--mem-fraction-static", "--random-seed", "--base-gpu-id"]
    assert set(expected + ["--weight-version", "--dtype", "--nccl-port"]) <= set(flags)
    value = dict(zip(args, args[1:]))
    assert (value["--model-path"], value["--port"], value["--tp-size"], value["--mem-fraction-static"], value["--nccl-port"]) == (
        "/snap/v00000003", "30001", "2", "0.7", "24000",
    )  # fmt: skip
    assert ("--api-key" in flags) == (with_key and config_file is None)
    assert ("--config" in flags) == (with_key and config_file is not None)


def test_each_engine_of_a_fleet_gets_its_own_gpus_and_seed_and_reports_sampled_logprobs(tmp_path: Path):
    """Engine i of a fleet starts on GPUs i x tp_size onwards (every one on GPU 0 would each try
    to take mem_fraction_static of it), with a seed of its own; every one reports the logprobs of
    the temperature-scaled distribution it samples from, as the trainer computes them, whatever
    the user's environment sets."""
    processes = [launcher.sglang_engine_process(engine_config(), "/m", 30000 + i, tmp_path / f"{i}.log", seed=7, index=i) for i in range(3)]
    values = [dict(zip(p.command, p.command[1:])) for p in processes]
    assert [(v["--base-gpu-id"], v["--random-seed"]) for v in values] == [("0", "7"), ("2", "8"), ("4", "9")]
    assert all(p.env == {"SGLANG_RETURN_ORIGINAL_LOGPROB": "0"} for p in processes), "temperature-scaled logprobs, as trained"


def test_each_sglang_engine_of_a_fleet_gets_its_own_distributed_port_apart_from_the_http_ports(tmp_path: Path):
    """Left to SGLang, the torch.distributed port is drawn from 22000-29999 at launch, where tandem
    picks the HTTP ports that SGLang binds minutes later: a sibling's store could take one."""
    from infra.engines.fleet import EngineFleet

    fleet = EngineFleet(engine_config(), 3, tmp_path, 0, tmp_path / "logs")
    nccl = [dict(zip(p.command, p.command[1:]))["--nccl-port"] for p in fleet.processes]
    assert nccl == [str(port) for port in fleet.nccl_ports] and len(set(fleet.nccl_ports) | set(fleet.ports)) == 6


def test_optional_flags_are_left_out_when_unset():
    flags = check_flags(launcher.sglang_server_args(engine_config(), "/m", 30000, None, 0))
    assert not {"--weight-version", "--dtype", "--api-key", "--config"} & set(flags)


def test_a_float32_checkpoint_is_served_with_an_attention_backend_that_runs_float32():
    """SGLang's default on Hopper, FlashAttention 3, runs fp16 and bf16 only."""
    value = dict(zip(args := launcher.sglang_server_args(engine_config(), "/m", 1, None, 0, dtype="float32"), args[1:]))
    assert value["--attention-backend"] == "triton"
    check_flags(args)
    assert "--attention-backend" not in launcher.sglang_server_args(engine_config(), "/m", 1, None, 0, dtype="bfloat16")


def test_sglang_args_go_after_tandems_own_and_choose_the_attention_backend():
    extra = ["--max-running-requests", "64", "--attention-backend", "flashinfer", "--enable-metrics"]
    args = launcher.sglang_server_args(engine_config(sglang_args=extra), "/m", 1, None, 0, dtype="float32")
    assert args[-len(extra):] == extra and args.count("--attention-backend") == 1
    check_flags(args)
    one_phase = ["--decode-attention-backend", "flashinfer"]
    args = launcher.sglang_server_args(engine_config(sglang_args=one_phase), "/m", 1, None, 0, dtype="float32")
    assert dict(zip(args, args[1:]))["--attention-backend"] == "triton", "the other phase's default stays float32-safe"
    check_flags(args)


@pytest.mark.parametrize("arg, owned", [
    ("--port", "--port"), ("--dtype=bfloat16", "--dtype"), ("--api-key", "--api-key"),
    ("--tensor-parallel-size", "--tensor-parallel-size"), ("--model", "--model-path"), ("--tp", "--tp-size"),
    ("--mem-frac", "--mem-fraction-static"),
])  # fmt: skip
def test_sglang_args_may_not_set_what_tandem_sets_by_any_name(arg: str, owned: str):
    with pytest.raises(ValueError, match=f"{owned} is set by tandem from"):
        engine_config(sglang_args=[arg, "1"])


def test_the_flags_tandem_sets_are_real_and_their_aliases_are_known():
    assert set(SGLANG_FLAGS_SET_BY_TANDEM) <= set(FLAGS)
    fields = {FLAGS[flag]["field"] for flag in SGLANG_FLAGS_SET_BY_TANDEM}
    assert {flag for flag, spec in FLAGS.items() if spec["field"] in fields} <= set(SGLANG_FLAGS_SET_BY_TANDEM)


def test_secret_config_keys_are_sglang_flags_and_tandem_dtypes_are_valid():
    for key in launcher.secret_config(engine_config(api_key=SECRET)):
        assert FLAGS[f"--{key}"]["takes_value"], key  # SGLang turns `key: value` into `--key value`
    dtypes = typing.get_args(ModelConfig.model_fields["dtype"].annotation)
    assert set(dtypes) <= set(FLAGS["--dtype"]["choices"])


def test_the_factory_pins_the_checkpoint_dtype(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "dtype": "float32"}))
    proc = launcher.sglang_engine_process(engine_config(), str(tmp_path), 30005, tmp_path / "log", weight_version="0")
    value = dict(zip(proc.command, proc.command[1:]))
    assert (value["--dtype"], value["--weight-version"]) == ("float32", "0")  # SGLang's "auto" would pick float16
    check_flags(proc.command)
    assert proc.url == "http://127.0.0.1:30005"
    assert "--dtype" not in launcher.sglang_engine_process(engine_config(), "/nowhere", 1, tmp_path / "l").command


# -- (b) the API key never shows --------------------------------------------------------------


def test_api_key_is_masked_in_repr_and_logged_command(tmp_path: Path, monkeypatch, caplog):
    proc = launcher.SGLangEngineProcess(engine_config(api_key=SECRET), "/m", 30002, tmp_path / "logs/sglang-0.log")
    assert SECRET not in repr(proc) and SECRET not in " ".join(proc.command)
    inline = launcher.sglang_server_args(engine_config(api_key=SECRET), "/m", 1, None, 0)
    assert SECRET in inline and SECRET not in " ".join(launcher.masked(inline))

    seen = {}

    def fake_launch(self):  # stands in for the real process: checks the secret file SGLang would read
        seen["mode"] = stat.S_IMODE(os.stat(self.config_file).st_mode)
        seen["config"] = yaml.safe_load(self.config_file.read_text())
        seen["log_mode"] = stat.S_IMODE(os.stat(self.log_path).st_mode)
        return self

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "sglang" else None)
    monkeypatch.setattr(EngineProcess, "launch", fake_launch)
    monkeypatch.setattr(EngineProcess, "wait_healthy", lambda self, timeout=None: seen.setdefault("waited", timeout) and self)
    with caplog.at_level(logging.DEBUG):
        proc.launch()  # as EngineFleet.start does: every engine launched, then each waited for
        assert proc.config_file.exists(), "SGLang reads the file after the launch"
        proc.wait_healthy()
    assert seen == {"mode": 0o600, "config": {"api-key": SECRET}, "log_mode": 0o600, "waited": None}
    assert not proc.config_file.exists(), "the secret file outlives the start"
    assert "--config" in caplog.text and SECRET not in caplog.text
    assert proc.start_timeout == 900.0, "a first SGLang start compiles and captures graphs"
    proc.launch()
    proc.stop()  # as EngineFleet.start does when another engine's launch or wait fails
    assert not proc.config_file.exists(), "a launched engine stopped before its wait leaves no key file"


def test_a_failed_start_shows_the_log_tail_with_the_key_masked(tmp_path: Path, monkeypatch):
    proc = launcher.SGLangEngineProcess(engine_config(api_key=SECRET), "/m", 30003, tmp_path / "sglang.log")
    # A stand-in server that logs its arguments as SGLang 0.5.23 does (key included) and dies.
    script = "import sys; print('server_args=', {'api_key': sys.argv[1]}); raise SystemExit(3)"
    proc.command = [sys.executable, "-c", script, SECRET]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    with pytest.raises(EngineStartError) as err:
        proc.start(timeout=30)
    assert "code 3" in str(err.value) and "server_args" in str(err.value)
    assert SECRET not in str(err.value) and launcher.MASK in str(err.value)
    assert not proc.config_file.exists()


def test_without_sglang_installed_start_names_the_extra(tmp_path: Path):
    assert "sglang" not in sys.modules, "importing the launcher must not import SGLang"
    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("SGLang is installed here")
    proc = launcher.SGLangEngineProcess(engine_config(), "/m", 30004, tmp_path / "sglang.log")
    with pytest.raises(EngineStartError, match=r"pip install 'tandem\[sglang\]'"):
        proc.start()
    assert proc.process is None


# -- (c) api.py against SGLang's names ---------------------------------------------------------


def test_fixture_names_its_sources():
    assert FIXTURE["sglang_version"] == "0.5.23"
    assert all(s["file"].startswith("sglang/") for s in STRUCTS.values())


@pytest.mark.parametrize("name", sorted(api.ROUTES))
def test_every_route_tandem_calls_exists(name: str):
    route(*api.ROUTES[name])


def test_routes_of_the_design_exist_and_old_names_are_deprecated_aliases():
    for method, path in [("POST", "/update_weight_version"), ("POST", "/flush_cache"), ("GET", "/health")]:
        route(method, path)
    for old, new in api.DEPRECATED_ROUTES.items():
        assert route("GET", old).get("deprecated_for") == new
    assert "/health" in FIXTURE["unauthenticated_path_prefixes"]["prefixes"]


@pytest.mark.parametrize(
    "model, path, contract",
    [
        (api.GenerateRequest, "/generate", "GenerateRequest"),
        (api.UpdateWeightsFromDiskRequest, "/update_weights_from_disk", None),
        (api.PauseGenerationRequest, "/pause_generation", None),
        (api.AbortRequest, "/abort_request", "AbortRequest"),
    ],
)
def test_request_fields_are_accepted_by_sglang(model, path, contract):
    body = route(*api.ROUTES[path.strip("/")])["body"]
    assert fields(model) <= set(STRUCTS[body]["fields"]), fields(model) - set(STRUCTS[body]["fields"])
    if contract:  # /generate and /abort_request bodies also pass SGLang's JSON contract
        assert fields(model) <= set(CONTRACT[contract]["fields"])


def test_sampling_params_are_sglang_sampling_params():
    ours = fields(api.SamplingParams)
    assert {"temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "n", "sampling_seed"} <= ours
    assert ours <= set(STRUCTS["SamplingParams"]["fields"])
    # SGLang answers 400 to an unknown sampling_params key: only contract names may be sent.
    assert CONTRACT["SamplingParams"]["unknown_keys"] == "rejected"
    assert ours <= set(CONTRACT["SamplingParams"]["fields"])
    assert api.SamplingParams.model_config["extra"] == "forbid"


def test_generate_request_and_weight_update_fields():
    assert {"input_ids", "sampling_params", "return_logprob", "rid"} <= set(STRUCTS["GenerateReqInput"]["fields"])
    assert {"model_path", "weight_version"} <= set(STRUCTS["UpdateWeightFromDiskReqInput"]["fields"])
    out = {"success", "message", "num_paused_requests"}
    assert out <= set(STRUCTS["UpdateWeightFromDiskReqOutput"]["fields"])
    assert out == set(FIXTURE["response_keys"]["handlers"]["update_weights_from_disk"])
    assert fields(api.UpdateWeightsFromDiskResponse) <= out


def test_pause_modes_match():
    assert FIXTURE["pause_modes"]["values"] == ["abort", "retract", "in_place"]
    mode = api.PauseGenerationRequest.model_fields["mode"].annotation
    assert list(typing.get_args(mode)) == FIXTURE["pause_modes"]["values"]


def test_response_fields_are_returned_by_sglang():
    meta = set(FIXTURE["generate_meta_info_keys"]["keys"])
    assert {"finish_reason", "prompt_tokens", "completion_tokens", "output_token_logprobs", "weight_version"} <= meta
    assert fields(api.GenerateMetaInfo) <= meta
    assert fields(api.GenerateMetaInfo) <= set(CONTRACT["GenerateMetaInfo"]["fields"])
    assert fields(api.GenerateResponse) <= set(FIXTURE["generate_output_keys"]["keys"])
    assert fields(api.GenerateResponse) <= set(CONTRACT["GenerateResponse"]["fields"])
    assert fields(api.ModelInfo) <= set(FIXTURE["response_keys"]["handlers"]["model_info"])
    assert CONTRACT["LogprobEntry"]["fields"] == ["logprob", "token_id", "text"]  # our tuple's order


def test_finish_reasons_match():
    kinds = FIXTURE["finish_reasons"]["types"]
    ours = set(typing.get_args(api.FinishReason.model_fields["type"].annotation))
    assert ours == set(kinds) == {"stop", "length", "abort"}
    assert kinds["stop"]["keys"] == ["type", "matched"]
    assert fields(api.FinishReason) <= {key for kind in kinds.values() for key in kind["keys"]}


def test_requests_refuse_unknown_and_malformed_fields():
    for bad in [{"input_ids": []}, {"input_ids": [1], "text": "x"}, {"input_ids": [-1]}]:
        with pytest.raises(ValueError):
            api.GenerateRequest.model_validate(bad)
    for bad in [{"top_k": 0}, {"top_k": -2}, {"n": 0}, {"temperature": -0.5}, {"top_p": 0}, {"bogus": 1}]:
        with pytest.raises(ValueError):
            api.GenerateRequest.model_validate({"input_ids": [1], "sampling_params": bad})
    with pytest.raises(ValueError):
        api.PauseGenerationRequest.model_validate({"mode": "inplace"})


def test_an_sglang_shaped_answer_parses():
    answer = {
        "text": "8 2", "output_ids": [11, 5, 2],
        "meta_info": {
            "id": "ab", "finish_reason": {"type": "stop", "matched": 2}, "prompt_tokens": 7,
            "completion_tokens": 3, "cached_tokens": 0, "weight_version": "3", "num_retractions": 0,
            "output_token_logprobs": [[-0.1, 11, None], [-0.2, 5, None], [-0.01, 2, None]], "e2e_latency": 0.2,
        },
    }  # fmt: skip
    parsed = api.GenerateResponse.model_validate(answer)
    assert parsed.meta_info.finish_reason.matched == 2
    assert [tok for _, tok, _ in parsed.meta_info.output_token_logprobs] == parsed.output_ids


@pytest.mark.skipif(not os.environ.get("TANDEM_SGLANG_SRC"), reason="set TANDEM_SGLANG_SRC to an unpacked SGLang wheel")
def test_fixture_regenerates_identically():
    spec = importlib.util.spec_from_file_location("record_sglang_api", ROOT / "scripts/record_sglang_api.py")
    recorder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recorder)
    assert recorder.record(Path(os.environ["TANDEM_SGLANG_SRC"])) == FIXTURE
