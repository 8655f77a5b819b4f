"""`radixrt launch` settings: flags generated from EngineConfig and ServerConfig, the one loader
(defaults < TOML < environment < flags), and validation. No model, no server."""

from __future__ import annotations

import argparse
import dataclasses
import os
import pickle

import pytest

from radixrt.cli import _launch_settings, build_parser, main
from radixrt.config import EngineConfig, ServerConfig, field_types, launch_fields, load_config

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "configs")
# The flags users and tests already call: they must keep their names.
EXISTING_FLAGS = (
    "--model --host --port --http-port --served-model-name --config --dtype --max-total-tokens "
    "--page-size --schedule-policy --disable-radix-cache --chunked-prefill-size "
    "--max-running-requests --max-waiting-requests --attention-backend --enable-torch-compile "
    "--log-level --grace-period --max-message-bytes --max-prompt-tokens --max-new-tokens-limit "
    "--max-requests-per-client --api-key --isolate-by-api-key --curve-keys "
    "--max-forward-failures --debug-faults"
).split()
# One non-default, valid value per field, as argv and as the field then holds it.
FLAG_VALUES = {
    "model": (["--model", "/m"], "/m"),
    "quantization": (["--quantization", "q4_k"], "q4_k"),
    "dtype": (["--dtype", "float32"], "float32"),
    "max_total_tokens": (["--max-total-tokens", "4096"], 4096),
    "page_size": (["--page-size", "16"], 16),
    "schedule_policy": (["--schedule-policy", "fcfs"], "fcfs"),
    "disable_radix_cache": (["--disable-radix-cache"], True),
    "disable_hybrid_swa_memory": (["--disable-hybrid-swa-memory"], True),
    "swa_full_tokens_ratio": (["--swa-full-tokens-ratio", "0.5"], 0.5),
    "chunked_prefill_size": (["--chunked-prefill-size", "512"], 512),
    "max_running_requests": (["--max-running-requests", "8"], 8),
    "attention_backend": (["--attention-backend", "torch"], "torch"),
    "max_prefill_tokens": (["--max-prefill-tokens", "2048"], 2048),
    "max_prefill_step_ms": (["--max-prefill-step-ms", "75.5"], 75.5),
    "disable_mixed_chunk": (["--disable-mixed-chunk"], True),
    "new_token_ratio": (["--new-token-ratio", "0.25"], 0.25),
    "seed": (["--random-seed", "7"], 7),
    "enable_hierarchical_cache": (["--enable-hierarchical-cache"], True),
    "hicache_ratio": (["--hicache-ratio", "3"], 3.0),
    "hicache_size": (["--hicache-size", "1.5"], 1.5),
    "hicache_write_policy": (["--hicache-write-policy", "write_back"], "write_back"),
    "hicache_storage_dir": (
        ["--enable-hierarchical-cache", "--hicache-storage-dir", "/kv"],
        "/kv",
    ),
    "hicache_storage_size": (["--hicache-storage-size", "2"], 2.0),
    "linear_kernel": (["--linear-kernel", "fma"], "fma"),
    "eviction_policy": (["--eviction-policy", "lfu"], "lfu"),
    "device": (["--device", "cpu"], "cpu"),
    "enable_torch_compile": (["--enable-torch-compile"], True),
    "disable_decode_chain": (["--disable-decode-chain"], True),
    "enable_deterministic_inference": (["--enable-deterministic-inference"], True),
    "disable_deterministic_inference": (["--disable-deterministic-inference"], True),
    "constrained_json_disable_any_whitespace": (
        ["--constrained-json-disable-any-whitespace"],
        True,
    ),
    "embedding_pooling": (["--embedding-pooling", "mean"], "mean"),
    "speculative_algorithm": (["--speculative-algorithm", "NGRAM"], "NGRAM"),
    "speculative_num_draft_tokens": (
        ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4"],
        4,
    ),
    "speculative_ngram_min_match_window_size": (
        ["--speculative-ngram-min-match-window-size", "2"],
        2,
    ),
    "speculative_ngram_max_match_window_size": (
        ["--speculative-ngram-max-match-window-size", "6"],
        6,
    ),
    "speculative_ngram_min_bfs_breadth": (["--speculative-ngram-min-bfs-breadth", "2"], 2),
    "speculative_ngram_max_bfs_breadth": (["--speculative-ngram-max-bfs-breadth", "4"], 4),
    "speculative_ngram_branch_length": (["--speculative-ngram-branch-length", "9"], 9),
    "host": (["--host", "0.0.0.0"], "0.0.0.0"),
    "port": (["--port", "1234"], 1234),
    "http_port": (["--http-port", "0"], 0),
    "served_model_name": (["--served-model-name", "m"], "m"),
    "max_waiting_requests": (["--max-waiting-requests", "40"], 40),
    "log_level": (["--log-level", "INFO"], "INFO"),
    "grace_period": (["--grace-period", "2.5"], 2.5),
    "max_message_bytes": (["--max-message-bytes", "4096"], 4096),
    "max_prompt_tokens": (["--max-prompt-tokens", "200"], 200),
    "max_new_tokens_limit": (["--max-new-tokens-limit", "64"], 64),
    "max_requests_per_client": (["--max-requests-per-client", "2"], 2),
    "api_key": (["--api-key", "k1,k2"], "k1,k2"),
    "isolate_by_api_key": (["--isolate-by-api-key"], True),
    "curve_keys": (["--curve-keys", "/keys"], "/keys"),
    "max_forward_failures": (["--max-forward-failures", "2"], 2),
    "debug_faults": (["--debug-faults", "forward"], "forward"),
    "dp_size": (["--dp-size", "2"], 2),
    "threads_per_replica": (["--threads-per-replica", "1"], 1),
    "dp_restart": (["--dp-restart"], True),
    "load_balance_method": (["--load-balance-method", "round_robin"], "round_robin"),
    "cache_threshold": (["--cache-threshold", "0.25"], 0.25),
    "balance_abs_threshold": (["--balance-abs-threshold", "64"], 64),
    "balance_rel_threshold": (["--balance-rel-threshold", "1.5"], 1.5),
    "kv_events_endpoint": (["--kv-events-endpoint", "tcp://*:5557"], "tcp://*:5557"),
    "reasoning_parser": (["--reasoning-parser", "qwen3"], "qwen3"),
    "responses_store_size": (["--responses-store-size", "7"], 7),
    "tool_call_parser": (["--tool-call-parser", "hermes"], "hermes"),
    "enable_auto_tool_choice": (["--enable-auto-tool-choice"], True),
}


@pytest.fixture(autouse=True)
def no_api_key_env(monkeypatch):
    monkeypatch.delenv("RADIXRT_API_KEY", raising=False)


def launch_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["launch"]


def parse(*argv: str) -> tuple[EngineConfig, ServerConfig]:
    return _launch_settings(build_parser().parse_args(["launch", *argv]))


def write_toml(tmp_path, text: str) -> str:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return str(path)


# ------------------------------------------------------------------ flags <-> fields


def test_every_flag_is_a_field_and_every_field_a_flag():
    actions = {a.dest: a for a in launch_parser()._actions if a.dest not in ("help", "config")}
    with_flag = {f.name for _, f in launch_fields() if f.metadata["cli"]}
    assert set(actions) == with_flag
    assert {f.name for _, f in launch_fields()} == with_flag
    for cls, f in launch_fields():
        if f.name not in actions:
            continue
        action, base = actions[f.name], field_types(cls)[f.name][0]
        assert action.option_strings == [f.metadata["flag"] or "--" + f.name.replace("_", "-")]
        assert action.default is None  # "not given": the TOML file and environment show through
        if base is bool:
            assert isinstance(action, argparse._StoreTrueAction)
        else:
            assert action.type is base and action.nargs is None
    flags = {s for a in launch_parser()._actions for s in a.option_strings}
    assert set(EXISTING_FLAGS) <= flags
    assert {"--max-prefill-tokens", "--new-token-ratio", "--eviction-policy", "--device"} <= flags


def test_the_two_configs_share_no_field_name():
    engine = {f.name for f in dataclasses.fields(EngineConfig)}
    assert not engine & {f.name for f in dataclasses.fields(ServerConfig)}


def test_no_flags_give_the_dataclass_defaults():
    assert parse() == (EngineConfig(), ServerConfig())
    assert load_config(environ={}) == (EngineConfig(), ServerConfig())
    assert ServerConfig().host == "127.0.0.1" and ServerConfig().loopback


def test_each_flag_sets_its_field():
    assert set(FLAG_VALUES) == {f.name for _, f in launch_fields() if f.metadata["cli"]}
    # enable_deterministic_inference excludes disable; speculation needs page_size 1.
    apart = (
        "enable_deterministic_inference",
        "speculative_algorithm",
        "speculative_num_draft_tokens",
    )
    together = {k: v for k, v in FLAG_VALUES.items() if k not in apart}
    argv = [arg for args, _ in together.values() for arg in args]
    engine, server = parse(*argv)
    for name, (_, want) in together.items():
        got = getattr(engine if hasattr(engine, name) else server, name)
        assert got == want and type(got) is type(want), name
    for name, (args, want) in FLAG_VALUES.items():  # one at a time, next to the defaults
        if name in ("isolate_by_api_key", "http_port", "enable_auto_tool_choice"):
            continue  # needs --api-key or --tool-call-parser; 0 is covered above
        engine, server = parse(*args)
        assert getattr(engine if hasattr(engine, name) else server, name) == want, name


def test_launch_help_lists_every_help_text_and_default(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "1000")  # no wrapping, so each text appears whole
    with pytest.raises(SystemExit) as e:
        main(["launch", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for _, f in launch_fields():
        if not f.metadata["cli"]:
            continue
        flag = f.metadata["flag"] or "--" + f.name.replace("_", "-")
        if f.metadata["hidden"]:
            assert flag not in out
            continue
        assert " ".join(f.metadata["help"].split()) in out, f.name
        if f.default is not False:
            default = f.metadata["unset"] if f.default is None else f.default
            env = f"${f.metadata['env']}, else " if f.metadata["env"] else ""
            assert f"default: {env}{default})" in out, f.name
    assert "one of lpm, fcfs, dfs-weight" in out and "$RADIXRT_API_KEY" in out


# ------------------------------------------------------------------ the one loader


def test_toml_then_environment_then_flags(tmp_path, monkeypatch):
    path = write_toml(tmp_path, 'port = 1111\npage-size = 8\napi_key = "toml-key"\n')
    engine, server = load_config(path, environ={})
    assert (engine.page_size, server.port, server.api_key) == (8, 1111, "toml-key")
    engine, server = load_config(path, environ={"RADIXRT_API_KEY": "env-key"})
    assert (engine.page_size, server.port, server.api_key) == (8, 1111, "env-key")
    assert load_config(path, environ={"RADIXRT_API_KEY": ""})[1].api_key == "toml-key"
    engine, server = load_config(
        path,
        {"port": 2222, "page_size": None, "api_key": "flag-key"},
        environ={"RADIXRT_API_KEY": "env-key"},
    )
    assert (engine.page_size, server.port, server.api_key) == (8, 2222, "flag-key")
    monkeypatch.setenv("RADIXRT_API_KEY", "env-key")  # through the command line
    assert parse("--config", path)[1].api_key == "env-key"
    engine, server = parse("--config", path, "--port", "3333", "--api-key", "flag-key")
    assert (engine.page_size, server.port, server.api_key) == (8, 3333, "flag-key")


def test_configs_parse():
    names = sorted(n for n in os.listdir(CONFIGS) if n.endswith(".toml"))
    assert {"default.toml", "tiny.toml", "llama3-8b-h200.toml"} <= set(names)
    for name in names:
        engine, server = parse("--config", os.path.join(CONFIGS, name))
        assert server.port > 0
    path = os.path.join(CONFIGS, "llama3-8b-h200.toml")
    engine, server = parse("--config", path, "--page-size", "32", "--port", "1234")
    assert engine.page_size == 32 and server.port == 1234 and server.host == "0.0.0.0"
    assert not engine.enable_torch_compile
    assert parse("--config", path, "--enable-torch-compile")[0].enable_torch_compile


def test_unknown_toml_keys_are_named(tmp_path):
    path = write_toml(tmp_path, 'colour = "red"\nmax-tokens = 5\npage_size = 4\n')
    with pytest.raises(ValueError, match=r"unknown settings \['colour', 'max_tokens'\]"):
        load_config(path, environ={})
    with pytest.raises(ValueError, match=r"unknown settings \['colour'\]"):
        load_config(flags={"colour": 1}, environ={})


def test_a_bad_toml_value_names_its_field(tmp_path):
    with pytest.raises(ValueError, match="port must be an integer"):
        load_config(write_toml(tmp_path, 'port = "30000"\n'), environ={})
    with pytest.raises(ValueError, match="disable_radix_cache must be true or false"):
        load_config(write_toml(tmp_path, "disable_radix_cache = 1\n"), environ={})


@pytest.mark.parametrize(
    "name, value",
    [
        ("host", ""),
        ("port", 0),
        ("port", 70000),
        ("port", True),
        ("http_port", -1),
        ("served_model_name", " "),
        ("max_waiting_requests", 0),
        ("log_level", "loud"),
        ("log_level", 3),
        ("grace_period", -1.0),
        ("grace_period", "30"),
        ("max_message_bytes", 0),
        ("max_prompt_tokens", -5),
        ("max_new_tokens_limit", 0),
        ("max_requests_per_client", 0),
        ("api_key", " , "),
        ("isolate_by_api_key", "yes"),
        ("curve_keys", ""),
        ("max_forward_failures", 0),
        ("responses_store_size", 0),
        ("debug_faults", ""),
        ("model", ""),
        ("dtype", "float8"),
        ("page_size", 0),
        ("max_total_tokens", 3),
        ("schedule_policy", "random"),
        ("attention_backend", "cuda"),
        ("new_token_ratio", 1.5),
        ("max_prefill_tokens", 0),
        ("max_prefill_step_ms", -1.0),
        ("max_prefill_step_ms", float("inf")),
        ("max_prefill_step_ms", float("nan")),
        ("eviction_policy", "fifo"),
        ("device", "tpu"),
        ("device", "cpu:0"),
        ("enable_torch_compile", "yes"),
        ("chunked_prefill_size", 2.0),
        ("speculative_algorithm", "EAGLE"),
        ("speculative_num_draft_tokens", 4),
        ("speculative_ngram_min_match_window_size", 0),
        ("speculative_ngram_branch_length", -1),
        ("tool_call_parser", "json"),
        ("tool_call_parser", ""),
        ("enable_auto_tool_choice", "yes"),
    ],
)
def test_an_invalid_value_names_its_field(name, value):
    with pytest.raises(ValueError, match=name):
        load_config(flags={name: value}, environ={})


def test_cross_field_checks():
    with pytest.raises(ValueError, match="http_port and port"):
        ServerConfig(port=8000, http_port=8000)
    with pytest.raises(ValueError, match="isolate_by_api_key needs an api_key"):
        ServerConfig(isolate_by_api_key=True)
    assert ServerConfig(isolate_by_api_key=True, api_key="k").isolate_by_api_key
    with pytest.raises(ValueError, match="enable_auto_tool_choice needs a tool_call_parser"):
        ServerConfig(enable_auto_tool_choice=True)
    assert ServerConfig(enable_auto_tool_choice=True, tool_call_parser="mistral")
    ServerConfig(port=8000, http_port=0)  # no HTTP: no clash


def test_the_command_line_reports_a_bad_setting(capsys):
    assert main(["launch", "--port", "0"]) == 2
    assert "radixrt: error: port must be a port number" in capsys.readouterr().err
    assert main(["launch", "--speculative-algorithm", "NGRAM", "--page-size", "4"]) == 2
    assert "speculative decoding needs page_size 1" in capsys.readouterr().err
    assert main(["launch", "--tool-call-parser", "pythonic"]) == 2
    err = capsys.readouterr().err
    assert "tool_call_parser 'pythonic' is not known" in err
    assert "hermes, qwen25, llama3, llama3_json, mistral" in err


# ------------------------------------------------------------------ ServerConfig


def test_server_config_derived_values():
    server = ServerConfig(api_key=" k1 , k2,,", log_level="INFO", host="0.0.0.0")
    assert server.api_keys == (b"k1", b"k2") and ServerConfig().api_keys == ()
    assert server.logging_level == 20 and not server.loopback


def test_server_config_is_frozen_and_crosses_processes():
    server = ServerConfig(port=1234, api_key="k", max_prompt_tokens=100)
    assert pickle.loads(pickle.dumps(server)) == server  # spawn pickles the children's args
    with pytest.raises(dataclasses.FrozenInstanceError):
        server.port = 1
    assert not hasattr(server, "__dict__")
