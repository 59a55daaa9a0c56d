"""Run configuration: shipped YAML files validate, overrides apply, bad configs exit 2 naming the field."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from configs import CONFIG_DIR, ConfigError, RunConfig, load_config
from configs.sections import TrainingConfig
from configs.loader import validate_config
from flows.cli import app
from flows.preflight import resolve_config
from tasks.envs import Environment, Prompt, StepResult
from tasks.envs.calculator import CalculatorEnv
from tasks.rundir import initialize_run, load_run_config

runner = CliRunner()


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_yaml_validates(path: Path):
    config = load_config(path)
    assert isinstance(config, RunConfig)


def test_deployed_yaml_is_tiny_yaml_deployed():
    """configs/deployed.yaml says it is the tiny run, deployed: it once sampled at the temperature
    that made weak tiny runs collapse, after tiny.yaml had moved off it."""
    tiny, deployed = (load_config(CONFIG_DIR / name).model_dump() for name in ("tiny.yaml", "deployed.yaml"))
    deployment = {"run_id", "storage", "dask", "prefect"}  # where it runs, not what it trains
    differ = sorted(key for key in tiny if key not in deployment and tiny[key] != deployed[key])
    assert differ == [], {key: (tiny[key], deployed[key]) for key in differ}


def test_overrides_are_parsed_as_yaml_scalars():
    config = load_config(
        CONFIG_DIR / "tiny.yaml",
        ["lag.max_lag=4", "training.lr=3e-4", "dask.address=null", "engine.api_key=abc", "run_id=r7"],
    )
    assert config.lag.max_lag == 4
    assert config.training.lr == pytest.approx(3e-4)
    assert config.dask.address is None
    assert config.engine.api_key.get_secret_value() == "abc"
    assert config.run_id == "r7"


def test_every_field_has_a_description():
    """Of every section, an optional one (`AutoscaleConfig | None`, an anyOf) included."""
    schema = RunConfig.model_json_schema()
    sections = {"config": schema} | schema["$defs"]
    assert "AutoscaleConfig" in sections
    for section, definition in sections.items():
        for name, prop in definition.get("properties", {}).items():
            assert prop.get("description"), f"{section}.{name} has no docstring"


def test_secrets_are_masked_when_dumped():
    config = load_config(None, ["storage.key=AKIAEXAMPLE", "storage.secret=s3cr3t", "engine.api_key=k3y"])
    dumped = config.model_dump_json()
    assert "AKIAEXAMPLE" not in dumped and "s3cr3t" not in dumped and "k3y" not in dumped
    assert "AKIAEXAMPLE" not in repr(config)


@pytest.mark.parametrize("field", ["engine.api_key", "storage.key", "storage.secret"])
def test_the_mask_of_a_dumped_secret_is_refused_naming_the_field(field: str):
    # config.json and `config show` write each secret as the mask; fed back as parameters, the
    # mask would otherwise become the secret.
    section, key = field.split(".")
    with pytest.raises(ConfigError, match=f"{field}: .*what a config dump shows in place of a secret"):
        validate_config({section: {key: "**********"}})


def test_an_override_that_is_not_yaml_is_taken_as_text():
    """Unquoted on the command line, the mask is YAML's alias mark, and a secret may start with
    that or another of YAML's marks: `&k3y` parsed as YAML is null, which turned the key off."""
    with pytest.raises(ConfigError, match="engine.api_key: .*what a config dump shows in place of a secret"):
        load_config(None, ["engine.api_key=**********"])
    for secret in ("*s3cr3t&", "&ab:cd", "&abc def", "#k3y", "!k3y"):
        config = load_config(None, ["storage.key=AKIA", f"storage.secret={secret}", f"engine.api_key={secret}"])
        assert config.storage.secret.get_secret_value() == secret == config.engine.api_key.get_secret_value()
    with pytest.raises(ConfigError, match="env.kwargs: .*dictionary"):
        load_config(None, ["env.kwargs={a: 1"])


def test_parameters_carry_the_secrets_only_when_asked_and_validate_again():
    config = load_config(None, ["storage.key=AKIAEXAMPLE", "storage.secret=s3cr3t", "engine.api_key=k3y"])
    assert set(config.secrets()) == {"engine.api_key", "storage.key", "storage.secret"}
    child = RunConfig.model_validate(json.loads(json.dumps(config.as_parameters(secrets=True))))
    assert child == config and child.engine.api_key.get_secret_value() == "k3y"
    event = RunConfig.model_validate(config.as_parameters(secrets=False))
    assert event.secrets() == {} and event.model_dump(exclude={"engine", "storage"}) == config.model_dump(exclude={"engine", "storage"})


BAD_CONFIGS = [
    # (yaml text, overrides, text the message must contain)
    ("lag:\n  max_lag: -1\n", [], "lag.max_lag"),
    ("lag:\n  max_lag: two\n", [], "lag.max_lag"),
    ("lag:\n  max_lagg: 1\n", [], "lag.max_lagg: unknown key; allowed here: max_lag"),
    ("bogus_section: {}\n", [], "bogus_section: unknown key"),
    ("", [], "empty"),
    ("- a\n- b\n", [], "mapping"),
    ("run_id: ../x\n", [], "run_id"),
    ("run_id: a/b\n", [], "run_id"),
    (f"run_id: {'r' * 65}\n", [], "run_id"),
    ("engine:\n  backend: tpu\n", [], "engine.backend: Input should be 'cpu', 'sglang' or 'sim'"),
    ("generation:\n  temperature: -0.5\n", [], "generation.temperature"),
    ("storage:\n  root: ftp://host/x\n", [], "storage.root"),
    ("model:\n  hidden_size: 100\n  num_heads: 3\n", [], "num_heads (3) must divide hidden_size"),
    ("model:\n  hidden_size: 12\n  num_heads: 4\n", [], "hidden_size / num_heads (12 / 4 = 3) must be even"),
    ("engine:\n  request_timeout_s: 60\n", [], "engine.request_timeout_s (60) must exceed engine.weight_load_timeout_s (120)"),
    ("training: 5\n", [], "training"),
    ("lag: [1, 2]\n", [], "lag"),
    ("env:\n  entrypoint: not an import path\n", [], "env.entrypoint"),
    ("seed: 1\n", ["lag.max_lag"], "expected section.field=value"),
    ("seed: 1\n", ["seed.x=1"], "seed is not a section"),
    ("training: {lr: 0}\n", [], "training.lr"),
    ("engine:\n  sglang_args: ['--trust-remote-code']\n", [], "engine.sglang_args: --trust-remote-code would run Python files"),
    ("engine:\n  sglang_args: ['--trust-remote']\n", [], "engine.sglang_args: --trust-remote-code would run Python files"),
    ("engine:\n  sglang_args: ['--enable-deterministic-inference']\n", [], "every sample of a group would come out the same"),
    ("engine:\n  sglang_args: ['--admin-api-key=k']\n", [], "engine.sglang_args: --admin-api-key would make SGLang's pause"),
    ("training: {device: gpu}\n", [], "training.device: device must be auto, cpu, cuda or cuda:N (N a GPU index), got 'gpu'"),
    ("training: {compute_dtype: float16}\n", [], "training.compute_dtype: Input should be 'auto', 'float32' or 'bfloat16'"),
    ("key: [unclosed\n", [], "not valid YAML"),
    ("prefect:\n  mode: deployed\nstorage:\n  key: AKIA\n  secret: s3cr3t\n", [], "storage.key and storage.secret must be null"),
    ("prefect:\n  mode: cloud\n", [], "prefect.mode: Input should be 'local' or 'deployed'"),
    ("prefect:\n  deployment: a/b\n", [], "prefect.deployment"),
    ("storage:\n  credentials_block: My Block\n", [], "storage.credentials_block"),
    ("env:\n  eval_prompts: 0\nprefect:\n  evaluate_every: 5\n", [], "env.eval_prompts must be at least 1"),
]


@pytest.mark.parametrize("text,overrides,expected", BAD_CONFIGS, ids=[c[2][:30] for c in BAD_CONFIGS])
def test_bad_config_exits_2_naming_the_field(tmp_path: Path, text, overrides, expected):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=None) as caught:
        load_config(path, overrides)
    assert expected in str(caught.value)
    args = ["config", "show", str(path)] + [f"--set={o}" for o in overrides]
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert expected in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"], "a bad config wrote something"


def test_missing_config_file_exits_2(tmp_path: Path):
    result = runner.invoke(app, ["config", "show", str(tmp_path / "nope.yaml")])
    assert result.exit_code == 2
    assert "no such config file" in result.output


@pytest.mark.parametrize("run_id", ["123", "1e3", "true", "null", "0.5"])
def test_run_id_option_is_taken_as_a_string(run_id: str):
    # --set values are YAML scalars, but --run-id is a name: "123" must not become an integer.
    assert resolve_config(CONFIG_DIR / "tiny.yaml", None, run_id).run_id == run_id


def test_config_show_prints_the_resolved_config_as_json():
    result = runner.invoke(app, ["config", "show", str(CONFIG_DIR / "tiny.yaml"), "--json", "--set", "lag.max_lag=3"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)
    assert shown["lag"]["max_lag"] == 3
    assert shown["training"]["publish_every"] == 1


def test_config_schema_is_json_schema_with_descriptions():
    result = runner.invoke(app, ["config", "schema"])
    assert result.exit_code == 0
    schema = json.loads(result.output)
    assert schema["additionalProperties"] is False
    assert "max_lag" in schema["$defs"]["LagConfig"]["properties"]


def test_console_script_exit_code_is_2_for_a_bad_config(tmp_path: Path):
    path = tmp_path / "bad.yaml"
    path.write_text("lag:\n  max_lag: two\n")
    done = subprocess.run(
        [sys.executable, "-m", "flows.cli", "config", "show", str(path)], capture_output=True, text=True
    )
    assert done.returncode == 2
    assert "lag.max_lag" in done.stderr


def test_init_writes_config_and_snapshot_once_and_refuses_a_changed_config(tmp_path: Path):
    root = f"file://{tmp_path}/runs"
    args = ["init", str(CONFIG_DIR / "tiny.yaml"), "--set", f"storage.root={root}", "--run-id", "r1", "--set", "training.warmup_steps=0"]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    run_dir = tmp_path / "runs" / "r1"
    recorded = json.loads((run_dir / "config.json").read_text())
    assert recorded["run_id"] == "r1" and recorded["storage"]["root"] == root
    assert (run_dir / "weights" / "v00000000" / "MANIFEST.json").exists()
    assert json.loads((run_dir / "weights" / "LATEST").read_text()) == {"version": 0}
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}

    assert runner.invoke(app, args).exit_code == 0, "init is idempotent"
    changed = runner.invoke(app, [*args, "--set", "lag.max_lag=4"])
    assert changed.exit_code == 2
    assert "lag.max_lag" in changed.output
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == before, "a refused init wrote something"
    for operational in ("training.steps=500", "prefect.generators=3", "dask.n_workers=1", "engine.max_batch_size=8",
                        "training.checkpoint_every=5", "env.eval_prompts=0", "storage.retry_seconds=60",
                        "storage.keep_last_snapshots=5", "generation.prompts_per_chunk=8"):  # fmt: skip
        again = runner.invoke(app, [*args, "--set", operational])
        assert again.exit_code == 0, f"{operational} changes how the run is run, not what it trains: {again.output}"
    assert json.loads((run_dir / "config.json").read_text()) == recorded, "config.json keeps the first start's values"
    older = dict(recorded, training={k: v for k, v in recorded["training"].items() if k != "gradient_checkpointing"})
    (run_dir / "config.json").write_text(json.dumps(older))  # recorded before the field existed
    assert runner.invoke(app, args).exit_code == 0, "a run from before training.gradient_checkpointing is continued"
    older = dict(recorded, training={k: v for k, v in recorded["training"].items() if not k.startswith("dynamic_sampling")})
    (run_dir / "config.json").write_text(json.dumps(older))  # recorded before the fields existed: it ran without
    assert runner.invoke(app, args).exit_code == 0, "a run from before training.dynamic_sampling is continued"
    with_it = runner.invoke(app, [*args, "--set", "training.dynamic_sampling=true"])
    assert with_it.exit_code == 2 and "training.dynamic_sampling" in with_it.output, "what it trains on did change"


def test_a_run_is_found_however_its_root_is_spelt_and_its_url_names_it(tmp_path: Path, monkeypatch):
    """A run started on the relative default root is continued under its absolute one, and a run
    URL (tandem eval's) names the run it points at, not the root its config.json recorded: from
    another directory or in a copy, that root is another place."""
    monkeypatch.chdir(tmp_path)
    base = ["init", str(CONFIG_DIR / "tiny.yaml"), "--run-id", "r1", "--set", "training.warmup_steps=0"]
    assert runner.invoke(app, [*base, "--set", "storage.root=file://./runs"]).exit_code == 0
    again = runner.invoke(app, [*base, "--set", f"storage.root=file://{tmp_path}/runs"])
    assert again.exit_code == 0, again.output
    (tmp_path / "moved").mkdir()
    shutil.copytree(tmp_path / "runs" / "r1", tmp_path / "moved" / "copy")
    monkeypatch.chdir(tmp_path / "moved")
    config = load_run_config(f"file://{tmp_path}/moved/copy")
    assert (config.storage.root, config.run_id) == (f"file://{tmp_path}/moved", "copy")


@pytest.mark.s3
def test_a_run_on_s3_is_read_back_as_its_storage_overrides_say(seaweed, monkeypatch):
    """`tandem eval s3://...` and retrain read config.json before they know the run's config: the
    storage overrides (endpoint, credentials, Secret block) are how they reach it."""
    from infra.storage import StorageRejected
    from tests.conftest import s3_storage_config

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    storage = s3_storage_config(seaweed)
    config = load_config(CONFIG_DIR / "tiny.yaml", ["run_id=on-s3", f"storage.root={storage.root}",
                                                    f"storage.endpoint_url={seaweed.endpoint_url}", "storage.key=k", "storage.secret=s"])  # fmt: skip
    initialize_run(config)
    reach = [f"storage.endpoint_url={seaweed.endpoint_url}", "storage.key=k", "storage.secret=s"]
    loaded = load_run_config(f"{storage.root}/on-s3", reach)
    assert loaded.run_id == "on-s3" and loaded.storage.endpoint_url == seaweed.endpoint_url
    with pytest.raises(StorageRejected, match="rejected the request, NoCredentialsError: Unable to locate credentials"):
        load_run_config(f"{storage.root}/on-s3", reach[:1])


def test_retrain_reaches_deployed_yaml_s_root_as_that_file_says_and_another_root_as_the_environment_does():
    from configs.sections import StorageConfig
    from flows.retrain import run_location

    deployed = StorageConfig(root="s3://tandem/runs/", endpoint_url="http://minio:9000", credentials_block="s3-creds")
    reach = ["storage.endpoint_url=http://minio:9000", "storage.credentials_block=s3-creds"]
    assert run_location(None, deployed) == ("s3://tandem/runs", reach)
    assert run_location("s3://tandem/runs", deployed) == ("s3://tandem/runs", reach)
    assert run_location("s3://elsewhere/runs", deployed) == ("s3://elsewhere/runs", [])
    assert run_location(None, StorageConfig(root="s3://tandem/runs")) == ("s3://tandem/runs", [])


def test_eval_of_a_run_without_held_out_prompts_exits_2_saying_how_to_give_it_some(tmp_path: Path):
    root = f"file://{tmp_path}/runs"
    init = runner.invoke(app, ["init", str(CONFIG_DIR / "tiny.yaml"), "--set", f"storage.root={root}", "--run-id", "quiet",
                               "--set", "env.eval_prompts=0", "--set", "training.warmup_steps=0"])  # fmt: skip
    assert init.exit_code == 0, init.output
    result = runner.invoke(app, ["eval", f"{root}/quiet"])
    assert result.exit_code == 2
    assert "env.eval_prompts is 0" in result.output and "--set env.eval_prompts=N" in result.output


def test_init_with_a_bad_config_writes_nothing(tmp_path: Path):
    result = runner.invoke(app, ["init", str(CONFIG_DIR / "tiny.yaml"), "--set", f"storage.root=file://{tmp_path}/runs", "--set", "lag.max_lag=-1"])
    assert result.exit_code == 2
    assert "lag.max_lag" in result.output
    assert list(tmp_path.iterdir()) == []


def test_config_show_json_leaves_secrets_out_and_says_how_to_supply_them():
    # Its output is what a deployed run is submitted with: "**********" would become the api key.
    result = runner.invoke(app, ["config", "show", str(CONFIG_DIR / "tiny.yaml"), "--json",
                                 "--set", "engine.api_key=k3y", "--set", "storage.key=AKIA", "--set", "storage.secret=s3cr3t"])  # fmt: skip
    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)
    assert shown["engine"]["api_key"] is None and shown["storage"]["secret"] is None and shown["storage"]["key"] is None
    assert "k3y" not in result.output and "s3cr3t" not in result.output and "AKIA" not in result.output and "*****" not in result.stdout
    assert "left out of the JSON (null): engine.api_key, storage.key, storage.secret." in result.stderr
    assert "AWS_ACCESS_KEY_ID" in result.stderr and "storage.credentials_block" in result.stderr
    plain = runner.invoke(app, ["config", "show", str(CONFIG_DIR / "tiny.yaml"), "--json"])
    assert plain.stderr == "", "nothing left out, nothing to say"


@pytest.mark.parametrize("override,expected", [
    ("storage.root=gs://x", "storage.root: root must start with file://, memory:// or s3://, got 'gs://x'"),
    ("run_id=a/b", "contain no '..', got 'a/b'"),
    ("lag.max_lag=two", "unable to parse string as an integer (got 'two')"),
])  # fmt: skip
def test_an_error_shows_the_value_once(override: str, expected: str):
    with pytest.raises(ConfigError) as caught:
        load_config(None, [override])
    assert str(caught.value).endswith(expected), str(caught.value)


@pytest.mark.parametrize("root,recorded", [
    ("file:///", "file:///"), ("file://./runs/", "file://./runs"), ("s3://bucket/prefix//", "s3://bucket/prefix"),
])  # fmt: skip
def test_storage_root_loses_trailing_slashes_but_not_its_scheme(root: str, recorded: str):
    assert load_config(None, [f"storage.root={root}"]).storage.root == recorded


@pytest.mark.parametrize("override,expected", [
    ("env.entrypoint=nope.mod:Cls", "env.entrypoint: environment entrypoint 'nope.mod:Cls': cannot import"),
    ("env.kwargs={digts: 3}", "env.kwargs: tasks.envs.calculator:CalculatorEnv refuses them"),
    ("env.kwargs={max_turns: 3}", "env.kwargs: tasks.envs.calculator:CalculatorEnv refuses them"),
    ("model.path=/nonexistent", "model.path '/nonexistent' is not an HF model directory (no config.json)"),
    ("model.path=Qwen/Qwen3-0.6B", "download it first (`hf download Qwen/Qwen3-0.6B --local-dir DIR`)"),
    ("env.kwargs={digits: 1}", "env.train_prompts: tasks.envs.calculator:CalculatorEnv (env.kwargs {'digits': 1}) cannot give 2000 train prompts"),
    ("storage.root=memory://runs", "storage.root memory://runs: memory:// lives in one process"),
    ("env.eval_prompts=100000", "env.eval_prompts: tasks.envs.calculator:CalculatorEnv (env.kwargs {'partial_credit': True}) cannot give 100000 eval"),
])  # fmt: skip
def test_initialize_run_refuses_what_does_not_load_before_writing_anything(tmp_path: Path, override: str, expected: str):
    from flows.pipeline import _worth_retrying
    from tasks.rundir import initialize_run

    config = load_config(CONFIG_DIR / "tiny.yaml", [f"storage.root=file://{tmp_path}/runs", override])
    with pytest.raises(ConfigError, match=None) as caught:
        initialize_run(config)
    assert expected in str(caught.value)
    assert ("hf download" in str(caught.value)) == ("Qwen" in override), "the hub hint only for what looks like a hub id"
    assert list(tmp_path.iterdir()) == [], "no config.json to refuse the corrected config later"

    class FailedState:
        def result(self):
            raise caught.value

    assert not _worth_retrying(None, None, FailedState()), "the pipeline reads the same error on a retry"


def test_a_run_id_of_digits_is_a_name_in_yaml_as_on_the_command_line():
    assert load_config(CONFIG_DIR / "tiny.yaml", ["run_id=2024"]).run_id == "2024"
    assert RunConfig.model_validate({"run_id": 7}).run_id == "7"


@pytest.mark.parametrize("written", ["007", "0777", "0x1F", "2024-12-07", "yes", "1_000"])
def test_a_text_field_is_read_as_written_in_a_file_and_an_override(tmp_path: Path, written: str):
    """YAML reads `007` as 7, `0777` as 511, `2024-12-07` as a date: run 007 was opened as run 7."""
    path = tmp_path / "run.yaml"
    path.write_text(f"run_id: {written}\nstorage:\n  key: {written}\n  secret: {written}\nlag:\n  max_lag: 0x2\n")
    from_file = load_config(path)
    assert from_file.run_id == written and from_file.storage.key.get_secret_value() == written
    assert from_file.lag.max_lag == 2, "a number field is YAML's number still"
    assert load_config(CONFIG_DIR / "tiny.yaml", [f"run_id={written}", f"engine.api_key={written}"]).run_id == written
    path.write_text("run_id: '7'\n")
    assert load_config(path).run_id == "7"


def test_a_section_whose_keys_are_all_commented_out_is_empty(tmp_path: Path):
    path = tmp_path / "run.yaml"
    path.write_text("training:\n  # steps: 5\nlag:\n  max_lag: 1\n")
    assert load_config(path, ["training.steps=7"]).training.steps == 7


def test_a_pretrained_model_gets_its_own_training_defaults_and_given_values_win(tmp_path: Path):
    config_file = tmp_path / "run.yaml"
    config_file.write_text("run_id: qwen\nmodel:\n  path: /models/qwen\n")
    pretrained = load_config(config_file)
    given = load_config(config_file, ["training.lr=3e-6", "training.warmup_steps=5"])
    assert (pretrained.training.lr, pretrained.training.warmup_steps, pretrained.training.micro_batch_size) == (1e-6, 0, 4)
    assert (given.training.lr, given.training.warmup_steps, given.training.warmup_lr) == (3e-6, 5, 1e-5)
    factory = RunConfig()
    assert (factory.training.lr, factory.training.warmup_steps, factory.training.micro_batch_size) == (1e-4, 55, None)
    built = RunConfig(model={"path": "/models/qwen"}, training=TrainingConfig(lr=2e-6))
    assert (built.training.lr, built.training.warmup_steps) == (2e-6, 0)
    recorded = RunConfig.model_validate_json(pretrained.model_dump_json())
    assert recorded.training == pretrained.training


def test_a_model_path_run_is_told_what_it_keeps_of_the_tiny_set_up_and_refused_a_context_past_the_model(tmp_path: Path):
    """`--set model.path=...` on a shipped tiny config keeps its learning rate and warm-start (the
    config gives them, so the pretrained defaults do not apply) and its 64-token episodes."""
    from infra.modelfactory import save_tiny_model
    from configs.sections import ModelConfig
    from tasks.rundir import pretrained_model_notes

    model = save_tiny_model(ModelConfig(max_position_embeddings=128), tmp_path / "model", seed=0)
    root = f"storage.root=file://{tmp_path}/runs"
    notes = pretrained_model_notes(load_config(CONFIG_DIR / "tiny.yaml", [root, f"model.path={model}"]))
    assert notes == [
        "model.path is set, and the config gives training.lr 0.0002, training.warmup_steps 50 where a pretrained "
        "model's defaults are 1e-06, 0: leave them out of the config to get those",
        "episodes are cut at model.max_position_embeddings (64) tokens; model.path's context is 128",
    ]
    plain = tmp_path / "plain.yaml"
    plain.write_text(f"run_id: plain\nmodel:\n  path: {model}\n  max_position_embeddings: 128\n")
    assert pretrained_model_notes(load_config(plain, [root])) == []
    with pytest.raises(ConfigError, match=r"model.max_position_embeddings \(256\) is past the context of model.path .* \(128\)"):
        initialize_run(load_config(plain, [root, "model.max_position_embeddings=256"]))
    assert not (tmp_path / "runs").exists()


class TrainOnlyEnv(CalculatorEnv):
    """An environment with no held-out split: it refuses to give eval prompts."""

    def prompts(self, split, count, seed):
        if split == "eval":
            raise ValueError("no eval split")
        return super().prompts(split, count, seed)


def test_an_environment_without_held_out_prompts_runs_with_none_asked_for(tmp_path: Path):
    from tasks.rundir import check_run_inputs
    from infra.storage import open_run_store

    overrides = [f"storage.root=file://{tmp_path}", "env.entrypoint=tests.test_config:TrainOnlyEnv"]
    config = load_config(CONFIG_DIR / "tiny.yaml", [*overrides, "env.eval_prompts=0"])
    check_run_inputs(config, open_run_store(config.storage, config.run_id))
    asked = load_config(CONFIG_DIR / "tiny.yaml", overrides)
    with pytest.raises(ConfigError, match="env.eval_prompts: tests.test_config:TrainOnlyEnv .* cannot give 200 eval prompts"):
        check_run_inputs(asked, open_run_store(asked.storage, asked.run_id))


class QuestionEnv(Environment):
    """Prompts of plain English, as a user's question-answering data set has."""

    def prompts(self, split, count, seed):
        return [Prompt(f"{split}-{i}", f"What is {i} plus one ?", str(i + 1)) for i in range(count)]

    def reset(self, prompt):
        return prompt.text

    def step(self, action):
        return StepResult("", 0.0, True)

    def demonstration(self, prompt):
        return []


def test_prompts_the_tiny_tokenizer_cannot_read_are_noted(tmp_path: Path):
    """The tiny built-in model knows only its tasks' words: a user's plain-text environment on it
    trained on <unk> after <unk>, and `tandem init` said nothing."""
    from tasks.rundir import prompt_vocabulary_notes

    root = f"storage.root=file://{tmp_path}/runs"
    assert prompt_vocabulary_notes(load_config(CONFIG_DIR / "tiny.yaml", [root])) == []
    text = load_config(CONFIG_DIR / "tiny.yaml", [root, "env.entrypoint=tests.test_config:QuestionEnv", "env.kwargs={}"])
    (note,) = prompt_vocabulary_notes(text)
    assert "of the tokens of the training prompts are unknown to the tiny built-in model's tokenizer" in note
    assert "give model.path to train on text" in note and "<unk>" in note


class UndemonstratedEnv(QuestionEnv):
    """An environment with no demonstrations, as most users' first one is."""

    demonstration = Environment.demonstration


def test_an_environment_without_demonstrations_runs_without_a_warm_start_and_is_refused_with_one(tmp_path: Path):
    """`demonstration` was abstract: an environment without one failed to load ("does not
    implement demonstration"), though only the warm-start asks for it."""
    base = [f"storage.root=file://{tmp_path}/runs", "env.entrypoint=tests.test_config:UndemonstratedEnv", "env.kwargs={}"]
    with pytest.raises(ConfigError, match="training.warmup_steps is 50, and tests.test_config:UndemonstratedEnv has no "
                                          "demonstration for the warm-start: write its `demonstration`, or set training.warmup_steps: 0"):
        initialize_run(load_config(CONFIG_DIR / "tiny.yaml", base))
    assert not (tmp_path / "runs").exists()
    store = initialize_run(load_config(CONFIG_DIR / "tiny.yaml", [*base, "training.warmup_steps=0"]))
    assert store.exists("weights/v00000000/MANIFEST.json")
