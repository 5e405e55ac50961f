"""The compiled-op build (zerotrain/ops/builder.py): folders keyed by the sources, a build lock
that names its owner, is taken over when the owner is dead and is waited on for a bounded time,
and the ``zerotrain-build-ops`` / ``zerotrain-report`` commands.

One tiny pybind11 op (no torch headers, seconds to build) is compiled once for the module, into a
folder planted with the stale locks a killed build leaves; everything else runs without a compiler.
"""
import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import time
import warnings

import pytest

from zerotrain.ops import builder, report

TINY_SOURCE = """
#include <pybind11/pybind11.h>
#include "tiny.h"
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", [] { return TINY_ANSWER; }); }
"""


def write_checkout(root, answer=42, header_comment=""):
    """A 'checkout' of the tiny op: a source and a header in an include folder."""
    os.makedirs(os.path.join(root, "inc"), exist_ok=True)
    with open(os.path.join(root, "tiny.cpp"), "w") as f:
        f.write(TINY_SOURCE)
    with open(os.path.join(root, "inc", "tiny.h"), "w") as f:
        f.write(f"#pragma once\n#define TINY_ANSWER {answer}\n{header_comment}\n")
    return str(root)


def tiny_spec(root, name="zt_test_tiny", **kw):
    return builder.OpSpec(name=name, sources=("tiny.cpp",), include_dirs=("inc",), root=root,
                          cflags=("-O0",), build_estimate_s=10, **kw)


def dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def plant_lock(directory, pid, host=None):
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, builder.LOCK_NAME), "w") as f:
        json.dump({"pid": pid, "host": host or socket.gethostname(), "started": time.time() - 5,
                   "op": "planted"}, f)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(builder.CACHE_DIR_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def tiny_built(tmp_path_factory):
    """The tiny op, built (strict) into a folder holding a dead owner's zerotrain.lock and the
    `lock` file cpp_extension's FileBaton leaves when a build is killed. Both used to hang."""
    base = tmp_path_factory.mktemp("tiny")
    spec = tiny_spec(write_checkout(str(base / "checkout")))
    missing = builder._missing_toolchain(spec)
    if missing is not None:
        pytest.skip(f"cannot compile here: {missing}")
    saved = os.environ.get(builder.CACHE_DIR_ENV)
    os.environ[builder.CACHE_DIR_ENV] = str(base / "cache")
    try:
        directory = builder.build_dir(spec)
        plant_lock(directory, dead_pid())
        open(os.path.join(directory, builder.BATON_NAME), "w").close()
        err = io.StringIO()
        t0 = time.monotonic()
        with contextlib.redirect_stderr(err):
            module = builder.load_op(spec, strict=True)
        yield dict(spec=spec, module=module, dir=directory, seconds=time.monotonic() - t0,
                   stderr=err.getvalue())
    finally:
        builder._CACHE.pop(spec.name, None)
        if saved is None:
            os.environ.pop(builder.CACHE_DIR_ENV, None)
        else:
            os.environ[builder.CACHE_DIR_ENV] = saved


@pytest.mark.timeout(400)
def test_stale_lock_of_dead_owner_is_taken_over(tiny_built):
    assert tiny_built["module"].answer() == 42
    assert "taking over the build lock" in tiny_built["stderr"]
    assert "is dead" in tiny_built["stderr"]
    # The one line that says a compile is happening, and where, before it happens.
    assert f"compiling op zt_test_tiny into {tiny_built['dir']}" in tiny_built["stderr"]
    assert "zerotrain-build-ops" in tiny_built["stderr"]
    assert not os.path.exists(os.path.join(tiny_built["dir"], builder.LOCK_NAME))
    assert builder.is_built(tiny_built["spec"], tiny_built["dir"])


@pytest.mark.timeout(400)
def test_stale_cpp_extension_baton_does_not_block_the_build(tiny_built, tmp_path):
    assert "left by a build that was killed" in tiny_built["stderr"]
    assert not os.path.exists(os.path.join(tiny_built["dir"], builder.BATON_NAME))
    # And directly: holding our lock clears a leftover baton.
    open(tmp_path / builder.BATON_NAME, "w").close()
    with builder.build_lock(str(tmp_path), "x", timeout_s=5):
        assert not (tmp_path / builder.BATON_NAME).exists()
        assert (tmp_path / builder.LOCK_NAME).exists()
    assert not (tmp_path / builder.LOCK_NAME).exists()


@pytest.mark.timeout(400)
def test_built_op_is_reused_without_compiling_or_locking(tiny_built, capfd, monkeypatch):
    spec = tiny_built["spec"]
    builder._CACHE.pop(spec.name, None)
    monkeypatch.setenv(builder.CACHE_DIR_ENV, os.path.dirname(os.path.dirname(tiny_built["dir"])))
    # A live owner's lock must not matter once the op is built.
    plant_lock(tiny_built["dir"], os.getpid())
    try:
        t0 = time.monotonic()
        module = builder.load_op(spec, strict=True)
        assert time.monotonic() - t0 < 30
        assert module.answer() == 42
        assert builder.build_dir_of(spec) == tiny_built["dir"]
        assert "compiling" not in capfd.readouterr().err
    finally:
        os.unlink(os.path.join(tiny_built["dir"], builder.LOCK_NAME))


@pytest.mark.timeout(120)
def test_build_folder_is_keyed_by_source_contents_and_flags(tmp_path, cache_dir):
    a = tiny_spec(write_checkout(tmp_path / "a"))
    b = tiny_spec(write_checkout(tmp_path / "b"))
    assert builder.build_dir(a) == builder.build_dir(b)  # identical contents share one build
    folder = os.path.basename(builder.build_dir(a))
    assert folder.startswith("zt_test_tiny-") and len(folder) == len("zt_test_tiny-") + 12
    assert os.path.dirname(builder.build_dir(a)) == builder.extensions_dir()
    assert builder.extensions_dir().startswith(str(cache_dir))

    source_changed = tiny_spec(write_checkout(tmp_path / "c", answer=7))
    header_changed = tiny_spec(write_checkout(tmp_path / "d", header_comment="// edited"))
    flags_changed = tiny_spec(str(tmp_path / "a"), ldflags=("-lm",))
    folders = {builder.build_dir(s) for s in (a, source_changed, header_changed, flags_changed)}
    assert len(folders) == 4
    # The real ops too: their folders are content-keyed, not shared per op name.
    assert os.path.basename(builder.build_dir(builder.CPU_ADAM)).startswith("zerotrain_cpu_adam-")


@pytest.mark.timeout(120)
def test_dead_owner_lock_is_taken_over_without_waiting(tmp_path):
    plant_lock(str(tmp_path), dead_pid())
    t0 = time.monotonic()
    with builder.build_lock(str(tmp_path), "x", timeout_s=60):
        owner = json.loads((tmp_path / builder.LOCK_NAME).read_text())
        assert owner["pid"] == os.getpid() and owner["host"] == socket.gethostname()
        assert {"started", "op"} <= set(owner)
    assert time.monotonic() - t0 < 10


@pytest.mark.timeout(120)
def test_live_owner_lock_times_out_with_a_clear_error(tmp_path, capfd):
    plant_lock(str(tmp_path), os.getpid())
    t0 = time.monotonic()
    with pytest.raises(builder.BuildLockTimeout) as err:
        with builder.build_lock(str(tmp_path), "x", timeout_s=1.0):
            pass
    assert time.monotonic() - t0 < 20
    message = str(err.value)
    assert str(tmp_path / builder.LOCK_NAME) in message
    assert f"pid {os.getpid()}" in message and builder.BUILD_TIMEOUT_ENV in message
    waiting = [ln for ln in capfd.readouterr().err.splitlines() if "waiting up to" in ln]
    assert len(waiting) == 1 and f"pid {os.getpid()}" in waiting[0]
    assert (tmp_path / builder.LOCK_NAME).exists()  # not ours to remove


@pytest.mark.timeout(120)
def test_lazy_load_falls_back_after_the_bounded_wait(tmp_path, cache_dir, monkeypatch):
    spec = tiny_spec(write_checkout(tmp_path / "src"), name="zt_test_tiny_lazy")
    if builder._missing_toolchain(spec) is not None:
        pytest.skip("no toolchain: load_op would not reach the lock")
    owner = subprocess.Popen(["sleep", "60"])
    try:
        plant_lock(builder.build_dir(spec), owner.pid)
        monkeypatch.setenv(builder.BUILD_TIMEOUT_ENV, "1")
        monkeypatch.delenv(builder.BUILD_POLICY_ENV, raising=False)
        t0 = time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert builder.load_op(spec) is None
        assert time.monotonic() - t0 < 20
        assert len([w for w in caught if "zt_test_tiny_lazy" in str(w.message)]) == 1
        error = builder.load_error(spec)
        assert "BuildLockTimeout" in error and f"pid {owner.pid}" in error
    finally:
        owner.kill()
        owner.wait()
        builder._CACHE.pop(spec.name, None)


@pytest.mark.timeout(120)
def test_bad_timeout_value_is_rejected(monkeypatch):
    monkeypatch.setenv(builder.BUILD_TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match=builder.BUILD_TIMEOUT_ENV):
        builder.build_timeout_s()


@pytest.mark.timeout(120)
def test_report_names_each_op_and_the_isa(capsys, cache_dir):
    assert report.main_report([]) == 0
    out = capsys.readouterr().out
    for spec in builder.ALL_OPS:
        assert f"op {spec.name}" in out
        assert builder.build_dir(spec) in out
    isa_lines = [ln for ln in out.splitlines() if ln.strip().startswith("ISA")]
    cpu_ops = [spec for spec in builder.ALL_OPS if not spec.cuda and spec.isa_env]
    assert len(isa_lines) == len(cpu_ops)  # one per SIMD CPU op, each naming its own variable
    for line, spec in zip(isa_lines, cpu_ops):
        assert spec.isa_env in line and any(i in line for i in ("avx512", "avx2", "scalar"))
    assert "built      no" in out  # a fresh cache
    assert "would use" in out and "apex" in out and builder.extensions_dir() in out


@pytest.mark.timeout(400)
def test_build_command_prints_each_folder(tiny_built, monkeypatch, capsys):
    spec = tiny_built["spec"]
    monkeypatch.setenv(builder.CACHE_DIR_ENV, os.path.dirname(os.path.dirname(tiny_built["dir"])))
    monkeypatch.setattr(builder, "ALL_OPS", (spec,))
    builder._CACHE.pop(spec.name, None)
    assert report.main(["--build"]) == 0
    assert f"{spec.name}: built in {tiny_built['dir']}" in capsys.readouterr().out
