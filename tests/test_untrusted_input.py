"""Untrusted input stays data: checkpoint code runs only with --trust-remote-code, and every malformed file or
option stops the run before collection with a usage error (exit 4) that names it.

The hypothesis tests fuzz config.json and capture (.npz) contents against the readers directly (every input
is refused with an error naming the file, or read as a valid one), and through a whole pytest run, whose exit
is 4 for every refused input. PARITY_FUZZ_EXAMPLES sets how many inputs the pytest-level fuzz tries (the
exits it saw are printed: run with ``-s`` to read them).
"""

from __future__ import annotations

import io
import json
import os
import platform
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fixtures.attention_captures import small_capture
from harness.attention import capture as capture_io
from harness.attention.layout import AttentionLayout
from harness.inputs import checkpoints
from harness.inputs.checkpoints import CheckpointError
from harness.judging import checks

pytestmark = pytest.mark.cpu

checkpoints.registered_kinds()  # the kinds' plugin modules imported here, not inside a pytester run's sandbox
FUZZ_EXAMPLES = int(os.environ.get("PARITY_FUZZ_EXAMPLES", "12"))
PREFILL, DENOISE = AttentionLayout(4, 6, 2, "prefill"), AttentionLayout(3, 6, 2, "denoise")

# ------------------------------------------------------------------ --trust-remote-code

EVIL = '''
from pathlib import Path

Path({marker!r}).write_text("remote code ran")
from transformers import Qwen3ForCausalLM


class EvilForCausalLM(Qwen3ForCausalLM):
    pass
'''


@pytest.fixture(scope="module")
def remote_code_dir(tmp_path_factory):
    """A plain Qwen3 causal LM with an auto_map and a modeling file beside it that leaves a marker when imported."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    root = tmp_path_factory.mktemp("remote")
    directory, marker = root / "qwen3_with_auto_map", root / "RAN"
    config = Qwen3Config(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=4)
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(directory)
    data = json.loads((directory / "config.json").read_text())
    data["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (directory / "config.json").write_text(json.dumps(data))
    (directory / "modeling_evil.py").write_text(EVIL.format(marker=str(marker)))
    return directory, marker


def test_a_checkpoint_with_an_auto_map_stops_the_run_without_the_flag(remote_code_dir, pytester):
    directory, marker = remote_code_dir
    result = pytester.runpytest("-p", "harness.plugin", "-m", "gpu", "--device", "cpu", f"--checkpoint={directory}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*--checkpoint: checkpoint {directory}: config.json has an auto_map*"
                                 "modeling_evil.py*not run without --trust-remote-code*"])
    assert not marker.exists(), "the checkpoint's own Python ran without --trust-remote-code"


def test_loading_refuses_remote_code_unless_trusted_and_records_what_ran(remote_code_dir):
    directory, marker = remote_code_dir
    found = checkpoints.detect(directory)
    assert found.remote_code and found.class_name == "Qwen3ForCausalLM"
    assert not checkpoints.trusted(), "remote code is off by default"
    with pytest.raises(CheckpointError, match=f"{directory}: .*pass --trust-remote-code"):
        checkpoints.load_model(found, torch.float32, "cpu")
    assert not marker.exists() and checkpoints.remote_code_ran() == []
    try:
        checkpoints.trust_remote_code(True)
        model = checkpoints.load_model(found, torch.float32, "cpu")
        assert type(model).__name__ == "EvilForCausalLM" and marker.exists()
        assert checkpoints.remote_code_ran() == [str(directory)]
    finally:
        checkpoints.trust_remote_code(False)
        marker.unlink(missing_ok=True)
    assert checkpoints.remote_code_ran() == []


REMOTE_CHECK = '''
import torch
from harness.inputs import checkpoints
from harness.judging.checks import register
from harness.judging.compare import exact


@register("demo.remote.load")
def remote_load(ctx):
    model = checkpoints.load_model(checkpoints.detect({directory!r}), torch.float32, "cpu")
    return exact().judge(torch.zeros(1), torch.zeros(1 + 0 * model.config.hidden_size))
'''

REMOTE_TESTS = '''
import pytest
from harness.judging import catalogue
from harness.judging import checks

catalogue.load(["demo_remote"], [])


@pytest.mark.cpu
def test_load(parity_session, parity_ctx):
    assert parity_session.check("demo.remote.load", parity_ctx).passed
'''


def test_the_report_records_that_remote_code_ran(remote_code_dir, pytester):
    directory, marker = remote_code_dir
    pytester.makepyfile(demo_remote=REMOTE_CHECK.format(directory=str(directory)), test_remote=REMOTE_TESTS)
    pytester.syspathinsert()
    try:
        refused = pytester.runpytest("-p", "harness.plugin", "--parity-report=out/refused.json")
        refused.assert_outcomes(failed=1)
        row = json.loads((pytester.path / "out/refused.json").read_text())["checks"][0]
        assert row["status"] == "failed" and row["error"]["type"] == "CheckpointError"
        assert "--trust-remote-code" in row["error"]["message"] and not marker.exists()
        checks.CHECKS.forget("demo.remote")
        trusted = pytester.runpytest("-p", "harness.plugin", "--trust-remote-code", "--parity-report=out/ran.json",
                                     "--parity-report=out/ran.md")
        trusted.assert_outcomes(passed=1)
        data = json.loads((pytester.path / "out/ran.json").read_text())
        assert data["remote_code"] == {"trusted": True, "ran": [str(directory)]}
        assert f"**remote code** allowed (--trust-remote-code); ran from: `{directory}`" in \
            (pytester.path / "out/ran.md").read_text()
    finally:
        marker.unlink(missing_ok=True)
        checks.CHECKS.forget("demo.remote")


# ------------------------------------------------------------------ config.json of any content

def _json_values() -> st.SearchStrategy:
    scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12)
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.text(max_size=8), inner, max_size=3), max_leaves=8)


CONFIG_BYTES = st.one_of(
    st.binary(max_size=48),
    _json_values().map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries({}, optional={key: _json_values() for key in ("architectures", "_class_name", "auto_map")}
                          ).map(lambda v: json.dumps(v).encode()),
    st.text(max_size=24).map(lambda t: ('{"architectures": ["' + t).encode()),  # cut off mid-value
    st.sampled_from([b"null", b"[]", b"{}", b"\xff\xfe{}", b"1" * 5000, b"[" * 5000, b'{"architectures": "X"}']),
)


def _config_dir(root: Path, raw: bytes) -> Path:
    directory = root / "checkpoint"
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_bytes(raw)
    return directory


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=CONFIG_BYTES)
def test_detect_reads_any_config_json_as_data(raw, tmp_path):
    directory = _config_dir(tmp_path, raw)
    try:
        found = checkpoints.detect(directory)
    except CheckpointError as err:
        message = str(err)
    else:
        assert isinstance(found.config, dict)  # only a JSON object of a registered kind gets through
        return
    assert str(directory) in message


@pytest.mark.parametrize(("content", "expected"), [
    (b"[1, 2]", "config.json holds a JSON array, expected a JSON object"),
    (b"null", "config.json holds a JSON null, expected a JSON object"),
    (b"\x89PNG\r\n\x1a\n\x00", "config.json is not UTF-8 text"),
    (b'{"_class_name": "SD3Transformer2DModel", "sample_size": NaN}', "config.json: field 'sample_size' is nan"),
    (b'{"_class_name": "SD3Transformer2DModel", "patch_size": null}',
     "config.json field 'patch_size' is null where SD3Transformer2DModel takes a value"),
    (b'{"architectures": 3}', "architectures must be a list of strings, got a JSON number"),
    (b'{"_class_name": ["X"]}', "_class_name must be a string, got a JSON array"),
    (None, "config.json is not a regular file"),
])
def test_a_malformed_config_is_a_usage_error_naming_it(content, expected, pytester):
    directory = pytester.path / "checkpoint"
    directory.mkdir()
    if content is None:
        (directory / "config.json").mkdir()
    else:
        (directory / "config.json").write_bytes(content)
    result = pytester.runpytest("-p", "harness.plugin", "-m", "gpu", f"--checkpoint={directory}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*--checkpoint: checkpoint {directory}: *{expected}*"])
    assert "Traceback" not in result.stderr.str() + result.stdout.str()


# ------------------------------------------------------------------ capture files of any content


def _npz_bytes(**arrays: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def _capture_arrays(layout: AttentionLayout) -> dict[str, np.ndarray]:
    capture = small_capture(layout, heads=1, head_dim=4)
    return {name: getattr(capture, name).numpy() for name in capture_io.CAPTURE_ARRAYS}


VALID = _npz_bytes(**_capture_arrays(PREFILL))


@st.composite
def _npz_contents(draw: st.DrawFn) -> bytes:
    """Garbage, a valid capture cut short or with bytes flipped, object arrays, wrong dtypes or missing arrays."""
    kind = draw(st.sampled_from(["garbage", "truncated", "flipped", "object", "dtype", "missing"]))
    if kind == "garbage":
        return draw(st.binary(max_size=64))
    if kind == "truncated":
        return VALID[:draw(st.integers(0, len(VALID) - 1))]
    if kind == "flipped":
        data = bytearray(VALID)
        for at in draw(st.lists(st.integers(0, len(VALID) - 1), min_size=1, max_size=4)):
            data[at] ^= draw(st.integers(1, 255))
        return bytes(data)
    arrays = _capture_arrays(PREFILL)
    name = draw(st.sampled_from(capture_io.CAPTURE_ARRAYS))
    if kind == "object":
        arrays[name] = np.array([{"a": 1}, None], dtype=object)
    elif kind == "dtype":
        arrays[name] = arrays[name].astype(draw(st.sampled_from([np.float64, np.int8, np.float16])))
    else:
        del arrays[name]
    return _npz_bytes(**arrays)


def _capture_dir(root: Path, raw: bytes) -> Path:
    directory = root / "captures"
    directory.mkdir(exist_ok=True)
    (directory / "call0_rank0.npz").write_bytes(raw)
    capture_io.save_capture(small_capture(DENOISE, heads=1, head_dim=4), directory / "call32_rank0.npz")
    return directory


def _read_back(path: Path) -> str:
    """How the readers take a capture file: "valid", or the ValueError's text (anything else escapes)."""
    try:
        capture_io.validate_file(path)
    except ValueError as err:
        message = str(err)
        with pytest.raises((ValueError, TypeError)):
            capture_io.load_capture(path)  # the loader refuses it too, in its own words
        return message
    capture_io.load_capture(path)
    return "valid"


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=_npz_contents())
def test_capture_files_of_any_content_are_refused_by_name_or_read(raw, tmp_path):
    path = _capture_dir(tmp_path, raw) / "call0_rank0.npz"
    outcome = _read_back(path)
    if outcome != "valid":
        assert str(path) in outcome or path.name in outcome, outcome
        assert "allow_pickle" not in outcome and "trust the file" not in outcome, outcome


@pytest.mark.parametrize(("content", "expected"), [
    (b"\x80\x04\x95garbage that numpy would try to unpickle", "not an npz archive"),
    (VALID[: len(VALID) // 2], "not an npz archive"),
    (_npz_bytes(**{**_capture_arrays(PREFILL), "mask": np.array([None], dtype=object)}), "object (pickled)"),
])
def test_a_bad_capture_is_a_usage_error_naming_the_file_without_pickle_advice(content, expected, pytester):
    directory = _capture_dir(pytester.path, content)
    result = pytester.runpytest("-p", "harness.plugin", f"--capture-dir={directory}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*--capture-dir {directory}: capture file {directory / 'call0_rank0.npz'}: "
                                 f"*{expected}*"])
    assert "allow_pickle" not in result.stderr.str()


def _planted(name: str, at: tuple[int, ...], value: object) -> bytes:
    arrays = _capture_arrays(PREFILL)
    arrays[name][at] = value
    return _npz_bytes(**arrays)


@pytest.mark.parametrize(("content", "expected"), [
    (_planted("key", (0, 3, 0, 2), np.nan), "array 'key' holds NaN at (batch, seq, head, dim) = (0, 3, 0, 2)"),
    (_planted("query", (0, 1, 0, 0), -np.inf), "array 'query' holds an infinite value at (batch, seq, head, dim) = "
                                               "(0, 1, 0, 0)"),
    (_planted("mask", (0, 0, 0), False), "mask row 0 of batch 0 admits no key (all False); every query must see "
                                         "at least one key"),
])
def test_a_capture_that_parses_but_is_not_attention_stops_the_run_naming_file_array_and_position(
        content, expected, pytester):
    """NaN, inf or a query row that sees no key would fail deep inside a check (a NaN noise floor, a span before
    row 0); the run refuses it at configure time instead, naming the file, the array and the first bad position."""
    directory = _capture_dir(pytester.path, content)
    pytester.makepyfile(test_never="def test_never():\n    raise AssertionError('ran')\n")
    result = pytester.runpytest("-p", "harness.plugin", f"--capture-dir={directory}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()
    assert f"--capture-dir {directory}: capture {directory / 'call0_rank0.npz'}: {expected}" in result.stderr.str()
    assert "ran" not in result.stdout.str()


def test_a_corrupted_capture_member_fails_its_crc_before_any_check(tmp_path):
    data = bytearray(VALID)
    at = VALID.index(b"\x93NUMPY", VALID.index(b"query.npy")) + 130  # past the 128-byte npy header: query's data
    data[at] ^= 0xFF
    path = _capture_dir(tmp_path, bytes(data)) / "call0_rank0.npz"
    with pytest.raises(ValueError, match=r"call0_rank0.npz: member 'query.npy' (is damaged \(Bad CRC|fails its CRC)"):
        capture_io.validate_directory(path.parent)
    with pytest.raises(ValueError, match=r"call0_rank0.npz: member 'query.npy' is damaged \(Bad CRC-32"):
        capture_io.load_capture(path)


def test_a_corrupted_capture_that_no_check_loads_is_refused_too(tmp_path):
    """A malformed file is a usage error wherever it sits in the directory, not only where a check reads."""
    data = bytearray(VALID)
    data[VALID.index(b"\x93NUMPY", VALID.index(b"query.npy")) + 130] ^= 0xFF
    directory = _capture_dir(tmp_path, VALID)
    (directory / "call7_rank1.npz").write_bytes(bytes(data))  # neither phase's file: no check would load it
    with pytest.raises(ValueError, match=r"call7_rank1.npz: member 'query.npy' (is damaged \(Bad CRC|fails its CRC)"):
        capture_io.validate_directory(directory)


def test_a_capture_directory_without_both_phases_is_refused(tmp_path):
    capture_io.save_capture(small_capture(PREFILL, heads=1, head_dim=4), tmp_path / "call0_rank0.npz")
    with pytest.raises(ValueError, match="holds no denoise capture"):
        capture_io.validate_directory(tmp_path)


# ------------------------------------------------------------------ options

@pytest.mark.parametrize(("args", "env", "expected"), [
    (["--parity-report=/proc/parity.json"], {}, "--parity-report /proc/parity.json: cannot be written"),
    (["--parity-report={tmp}/file/report.md"], {}, "--parity-report {tmp}/file/report.md: cannot be written"),
    (["--parity-report={tmp}/folder.json"], {}, "--parity-report {tmp}/folder.json: is a directory"),
    (['--device-map={"0": "lots"}'], {}, "--device-map '{\"0\": \"lots\"}': memory 'lots'"),
    (['--device-map={"99": "1GiB"}'], {}, "--device-map {\"99\": \"1GiB\"}: GPUs ?99? are not visible"),
    ([], {"PARITY_START_METHOD": "forkserver"}, "PARITY_START_METHOD='forkserver': expected one of spawn, fork"),
    (["--fault-bound=0"], {}, "--fault-bound='0': expected a number of seconds >= 3"),
    ([], {"PARITY_FAULT_BOUND_S": "soon"}, "PARITY_FAULT_BOUND_S='soon'"),
    ([], {"PARITY_SPACE": "ful"}, "PARITY_SPACE='ful': expected one of pairwise, full"),
    (["--capture-dir={tmp}/file"], {}, "--capture-dir {tmp}/file is a file; expected a directory of capture files"),
    (["--capture-dir={tmp}/loop"], {}, "--capture-dir {tmp}/loop is a symlink loop; expected a directory"),
])
def test_malformed_options_are_usage_errors_before_any_check(args, env, expected, pytester, monkeypatch):
    (pytester.path / "file").write_text("a file where a directory is expected")
    (pytester.path / "folder.json").mkdir()
    (pytester.path / "loop").symlink_to(pytester.path / "loop")
    pytester.makepyfile(test_never="def test_never():\n    raise AssertionError('ran')\n")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    tmp = str(pytester.path)
    result = pytester.runpytest("-p", "harness.plugin", *[a.replace("{tmp}", tmp) for a in args])
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()
    result.stderr.fnmatch_lines([f"*{expected.replace('{tmp}', tmp)}*"])
    assert "ran" not in result.stdout.str()


def test_a_report_path_checked_at_configure_leaves_no_file_behind(pytester):
    pytester.makepyfile(test_fine="def test_fine():\n    pass\n")
    result = pytester.runpytest("-p", "harness.plugin", "--parity-report=deep/new/report.json")
    result.assert_outcomes(passed=1)
    assert not (pytester.path / "deep/new/report.json").exists(), "no parity item ran, so no report is written"


# ------------------------------------------------------------------ the fuzz, through whole pytest runs


@pytest.fixture(scope="module")
def exits() -> Counter:
    seen: Counter = Counter()  # (what was fuzzed, refused or read as valid, exit code) -> runs
    yield seen
    for what in ("config.json", ".npz"):
        mine = {(verdict, code): n for (kind, verdict, code), n in sorted(seen.items()) if kind == what}
        print(f"\nfuzzed {what}: {sum(mine.values())} pytest runs; (refused|valid, exit) -> runs: {mine}")


@settings(max_examples=FUZZ_EXAMPLES, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(fuzzed=st.tuples(st.just("config.json"), CONFIG_BYTES) | st.tuples(st.just(".npz"), _npz_contents()))
def test_fuzzed_inputs_stop_the_run_with_exit_4(fuzzed, pytester, exits):
    """A config.json or capture file of fuzzed content: exit 4 before collection, or a valid file (counted)."""
    what, raw = fuzzed
    npz = what == ".npz"
    root = pytester.path / f"input{sum(exits.values())}"  # hypothesis reuses one pytester directory
    root.mkdir()
    if npz:
        directory = _capture_dir(root, raw)
        option = f"--capture-dir={directory}"
        refused = _read_back(directory / "call0_rank0.npz") != "valid"
    else:
        directory = _config_dir(root, raw)
        option = f"--checkpoint={directory}"
        try:
            checkpoints.require_trust(checkpoints.detect(directory))
            refused = False
        except CheckpointError:
            refused = True
    result = pytester.runpytest_inprocess("-p", "harness.plugin", "-m", "gpu", "--co", "-q", option, str(root))
    exits[(what, "refused" if refused else "valid", int(result.ret))] += 1
    if refused:
        assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stderr.str()
        assert str(directory) in result.stderr.str()
    else:
        assert result.ret != pytest.ExitCode.INTERNAL_ERROR


@pytest.mark.parametrize(("value", "threads"), [("", 1), ("3", 3), (" 2 ", 2), ("-2", None), ("two", None),
                                                ("1.5", None)])
def test_the_thread_count_is_a_positive_integer_or_the_default(value, threads, monkeypatch):
    from harness.inputs import host

    monkeypatch.setenv("PARITY_THREADS", value)
    if threads is not None:
        assert host.threads_from_environment() == threads
    else:
        with pytest.raises(ValueError, match=rf"PARITY_THREADS={value!r}: expected a positive integer"):
            host.threads_from_environment()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_freed_memory_is_kept_for_the_next_tensor_where_glibc_allows_it():
    """Every mallopt call is accepted: a value glibc refuses would leave the CPU tier on its slow default silently."""
    from harness.inputs import host

    assert host.keep_freed_memory() is True


def test_a_capture_array_that_needs_unpickling_is_refused_not_loaded(tmp_path: Path) -> None:
    path = tmp_path / "pickled.npz"
    np.savez(path, query=np.array([object()], dtype=object), key=np.zeros(1), value=np.zeros(1), mask=np.ones(1))
    with pytest.raises(ValueError, match="allow_pickle"):
        capture_io.check_values(path)


def test_a_pipe_where_a_file_belongs_is_named_a_pipe(tmp_path: Path) -> None:
    pipe = tmp_path / "fifo"
    os.mkfifo(pipe)
    said = checkpoints.not_a_file(pipe, "a config.json")
    assert said == f"{pipe} is not a regular file (a device, a socket or a pipe); expected a config.json"

