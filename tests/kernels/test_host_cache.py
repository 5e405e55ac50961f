"""The host allocator cache (csrc/host_cache/host_cache.cpp, zerotrain/ops/host_cache.py).

It replaces torch's CPU allocator for the whole process, so every case runs in a fresh Python
subprocess. Checked: a freed block comes back for the next allocation of its size (same address,
no new page faults); allocations of other sizes take kept pages (carved or moved) instead of
faulting fresh ones, with their contents intact, from fewer than 64 runs per block and none once
the blocks hold 16384 runs (the mappings' bound); the kept bytes never take the large blocks in
use plus those kept above the high-water mark (plus the slack); small blocks, raw allocations and
a fork still work; results of ops are unchanged; a mapping that fails raises torch's
out-of-memory error and leaves the books (fresh, assembled, live bytes) as they were; `empty()`
and `disable()` hand everything back; a process that asked torch for huge pages
(THP_MEM_ALLOC_ENABLE=1) keeps torch's allocator.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from zerotrain.ops import builder

from native_ops import load_native  # tests/kernels/ is on sys.path (conftest)

MiB = 1 << 20


@pytest.fixture(scope="module", autouse=True)
def built():
    load_native(builder.HOST_CACHE)  # builds it here once (or skips without a toolchain)


def run(body: str, timeout: float = 120, build_ops: str = "1") -> dict:
    """Run ``body`` in a fresh interpreter with ``cache`` (zerotrain.ops.host_cache) imported, under
    ``ZEROTRAIN_BUILD_OPS=build_ops``; it prints one JSON object last, which is returned."""
    code = "import json, os, resource, torch\nfrom zerotrain.ops import host_cache as cache\n" + textwrap.dedent(body)
    scale = float(os.environ.get("ZEROTRAIN_TEST_TIMEOUT_SCALE", "1"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout * scale,
                          env={**os.environ, "ZEROTRAIN_BUILD_OPS": build_ops, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_freed_block_is_reused_without_new_page_faults():
    out = run("""
        faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        def churn():  # 20 fresh 32 MiB tensors, each written in full
            before = faults()
            for _ in range(20):
                t = torch.ones(8 << 20)
                del t
            return faults() - before
        plain = churn()
        assert cache.enable(1 << 20)
        a = torch.empty(8 << 20); ptr = a.data_ptr(); del a
        b = torch.empty(8 << 20); same = b.data_ptr() == ptr; del b
        cached = churn()
        print(json.dumps({"plain": plain, "cached": cached, "same": same, **cache.stats()}))
    """)
    assert out["installed"] == 1 and out["same"]
    assert out["plain"] >= 20 * 8192 * 0.9  # each fresh 32 MiB faults its 8192 pages
    assert out["cached"] < out["plain"] / 10, out
    assert out["hits"] >= 21 and out["misses"] == 1


@pytest.mark.parametrize("slack", [0, 3 * MiB])
def test_kept_pages_serve_other_sizes_within_the_high_water_mark(slack):
    out = run(f"""
        import random
        assert cache.enable(1 << 20, {slack})
        faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        rng = random.Random(0)
        held, worst, peak_seen, wrong = [], 0, 0, 0
        for i in range(3000):
            if i == 1000:
                warm = faults()
            if held and (rng.random() < 0.5 or len(held) > 12):
                value, t = held.pop(rng.randrange(len(held)))
                wrong += int(not bool(t[::4096].eq(value).all()))  # one byte per page, a small tensor
                del t
            else:
                t = torch.empty(rng.choice([1, 2, 3, 5, 8]) << 20, dtype=torch.uint8)
                t.fill_(i % 251)
                held.append((i % 251, t))
                del t
            s = cache.stats()
            peak_seen = max(peak_seen, s["live_bytes"])
            assert s["peak_bytes"] == peak_seen, (s, peak_seen)
            worst = max(worst, s["live_bytes"] + s["cached_bytes"] - s["peak_bytes"])
        print(json.dumps({{"worst": worst, "wrong": wrong, "late_faults": faults() - warm, **cache.stats()}}))
    """)
    assert out["worst"] <= slack, out  # live + kept never above the high-water mark + slack
    assert out["wrong"] == 0  # moved and carved pages keep what their tensor wrote
    # Sizes differ from those freed before them, yet pages are mapped afresh only up to the peak
    # and, once it is reached, there are no page faults at all (this churn's pages: 18k).
    assert out["fresh_bytes"] == out["peak_bytes"] and out["evicted"] == 0, out
    assert out["late_faults"] < 500, out
    assert out["hits"] > 1000 and out["carved"] > 50 and out["assembled"] > 50 and out["slack_bytes"] == slack


def test_ops_small_blocks_raw_allocations_and_fork_work_unchanged():
    out = run("""
        torch.manual_seed(0)
        x, w = torch.randn(512, 4096), torch.randn(4096, 1024)
        def work():  # gelu frees through the allocator's raw deleter; small and large blocks mixed
            y = torch.nn.functional.gelu(x @ w)
            return [y.sum().item(), torch.log_softmax(y, -1).sum().item(), torch.randn(7).sum().item()]
        torch.manual_seed(1); plain = work()
        assert cache.enable(1 << 20)
        torch.manual_seed(1); first = work()
        torch.manual_seed(1); second = work()
        small = torch.empty(1000); stats = cache.stats()
        pid = os.fork()
        if pid == 0:  # the child allocates through the inherited cache
            t = torch.ones(4 << 20); os._exit(0 if t.sum().item() == 4 << 20 else 3)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"plain": plain, "first": first, "second": second, "child": status, **stats}))
    """)
    assert out["first"] == out["plain"] and out["second"] == out["plain"]
    assert out["child"] == 0 and out["hits"] > 0


def test_empty_and_disable_hand_everything_back():
    out = run("""
        assert cache.enable(1 << 20)
        for _ in range(3):
            t = torch.empty(4 << 20); u = torch.empty(2 << 20); del t, u
        kept = cache.stats()["cached_bytes"]
        freed = cache.empty()
        after_empty = cache.stats()
        v = torch.empty(4 << 20)  # in use across disable(): freed, not kept, afterwards
        cache.disable()
        w = torch.empty(4 << 20); del v, w
        print(json.dumps({"kept": kept, "freed": freed, "after_empty": after_empty, **cache.stats()}))
    """)
    assert out["kept"] == 24 * MiB and out["freed"] == out["kept"]
    assert out["after_empty"]["cached_bytes"] == 0 and out["after_empty"]["peak_bytes"] == 0
    assert out["installed"] == 0 and out["cached_bytes"] == 0 and out["live_bytes"] == 0


def test_without_the_compiled_op_torch_keeps_its_allocator():
    out = run("""
        ok = cache.enable(1 << 20); t = torch.ones(4 << 20)
        print(json.dumps({"enabled": ok, "stats": cache.stats(), "sum": t.sum().item()}))
    """, timeout=60, build_ops="0")
    assert out == {"enabled": False, "stats": None, "sum": float(4 << 20)}


def test_an_assembled_block_takes_pages_from_at_most_63_mappings():
    out = run("""
        assert cache.enable(1 << 20)
        pieces = [torch.full((1 << 20,), i, dtype=torch.uint8) for i in range(80)]
        del pieces  # 80 kept blocks of 1 MiB, one mapping each
        before = cache.stats()
        big = torch.empty(80 << 20, dtype=torch.uint8)
        big.fill_(7)
        print(json.dumps({"before": before, "ok": bool(big[::4096].eq(7).all()), **cache.stats()}))
    """)
    assert out["before"]["cached_bytes"] == 80 * MiB and out["before"]["runs"] == 80 and out["ok"]
    # 63 blocks move their pages in, 17 MiB are fresh, and the 17 blocks left are freed for the bound
    assert out["assembled"] == 1 and out["evicted"] == 17 and out["cached_bytes"] == 0
    assert out["fresh_bytes"] == 97 * MiB and out["peak_bytes"] == 80 * MiB and out["runs"] == 64


@pytest.mark.parametrize("kept", [16383, 16384])
def test_no_pages_move_once_the_blocks_hold_16384_runs(kept):
    out = run(f"""
        page = 4096
        assert cache.enable(page)
        cache.empty()  # nothing kept: the single pages below are the only kept blocks
        start = cache.stats()["runs"]  # blocks of a page or more already in use
        pages = [torch.empty(page, dtype=torch.uint8) for _ in range({kept} - start)]
        del pages  # kept, one run each: in use and kept, the blocks hold {kept} runs
        before = cache.stats()
        block = torch.empty(8 * page, dtype=torch.uint8)  # larger than any kept block: assembled
        block.fill_(3)
        after = cache.stats()
        print(json.dumps({{"before": before, "after": after, "ok": bool(block.eq(3).all())}}))
    """)
    before, after = out["before"], out["after"]
    assert before["runs"] == kept and out["ok"]
    moved = before["cached_bytes"] - after["cached_bytes"] - (after["evicted"] - before["evicted"]) * 4096
    fresh = after["fresh_bytes"] - before["fresh_bytes"]
    if kept == 16383:  # under 16384 runs: all 8 pages move in
        assert moved == 8 * 4096 and fresh == 0 and after["assembled"] - before["assembled"] == 1
        assert after["runs"] == kept  # 8 runs moved into the new block, none added
    else:  # 16384 runs: none moves; the 8 pages mapped afresh push 8 kept ones out
        assert moved == 0 and fresh == 8 * 4096 and after["assembled"] == before["assembled"]
        assert after["evicted"] - before["evicted"] == 8
        assert after["runs"] == kept - 8 + 1


def test_a_failed_mapping_raises_and_leaves_the_books_as_they_were():
    out = run("""
        assert cache.enable(1 << 20)
        cache.empty()
        def vm():  # the process's address space now, bytes
            with open("/proc/self/status") as f:
                return next(int(line.split()[1]) for line in f if line.startswith("VmSize:")) * 1024
        def fail(n):  # n bytes asked for with 32 MiB of address space left: mmap fails
            soft, hard = resource.getrlimit(resource.RLIMIT_AS)
            resource.setrlimit(resource.RLIMIT_AS, (vm() + (32 << 20), hard))
            try:
                torch.empty(n, dtype=torch.uint8)
                return "no error"
            except RuntimeError as e:
                return str(e)
            finally:
                resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        if hard != resource.RLIM_INFINITY and hard < vm() + (32 << 20):
            print(json.dumps({"skip": f"RLIMIT_AS's hard limit {hard} is too low to set one"})); raise SystemExit
        torch.ones(16).add_(1)  # torch's lazy set-up done before any limit
        start = cache.stats()
        fresh_error = fail(256 << 20)  # nothing kept: all of it would be fresh pages
        after_fresh = cache.stats()
        kept = torch.ones(8 << 20, dtype=torch.uint8); del kept  # 8 MiB kept
        before = cache.stats()
        assembled_error = fail(256 << 20)  # would move the kept 8 MiB in, then fresh pages
        after = cache.stats()
        t = torch.ones(256 << 20, dtype=torch.uint8)  # the limit lifted: it maps
        print(json.dumps({"start": start, "after_fresh": after_fresh, "before": before, "after": after,
                          "errors": [fresh_error, assembled_error], "sum": t[::4096].sum().item(),
                          "end": cache.stats()}))
    """)
    if "skip" in out:
        pytest.skip(out["skip"])
    start, after_fresh, before, after, end = (out[k] for k in ("start", "after_fresh", "before", "after", "end"))
    for error in out["errors"]:
        assert "host cache: can't allocate memory" in error and str(256 * MiB) in error
    for key in ("fresh_bytes", "assembled", "live_bytes", "cached_bytes"):
        assert after_fresh[key] == start[key], key
    # the failed assembly lost the kept block (unmapped with the error) and mapped nothing
    assert before["cached_bytes"] == 8 * MiB and after["cached_bytes"] == 0
    for key in ("fresh_bytes", "assembled", "live_bytes"):
        assert after[key] == before[key], key
    assert end["fresh_bytes"] == after["fresh_bytes"] + 256 * MiB and out["sum"] == 256 * MiB // 4096
    assert end["misses"] == start["misses"] + 4  # the 8 MiB, the two failures, the last one


def test_a_process_that_asks_torch_for_huge_pages_keeps_torchs_allocator():
    out = run("""
        os.environ["THP_MEM_ALLOC_ENABLE"] = "1"  # enable() reads it when called
        declined = cache.enable(1 << 20)
        os.environ["THP_MEM_ALLOC_ENABLE"] = "0"
        print(json.dumps({"declined": declined, "stats": cache.stats(), "then": cache.enable(1 << 20)}))
    """)
    assert out["declined"] is False and out["stats"] is None  # not even loaded
    assert out["then"] is True  # "0": the cache installs as usual
