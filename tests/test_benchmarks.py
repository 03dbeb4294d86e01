"""The benchmark scripts run end to end (tiny budgets) and write the JSON the README quotes.

Speed is not asserted here (benchmarks/README.md holds the figures); what is asserted is that
every table the README shows is produced, with sane numbers, so the scripts cannot rot.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from benchmarks import cluster as cluster_benchmark
from benchmarks import imb, recorder_instructions, train_scaling, tuning
from launcher.mpi import cxx as mpi_cxx
from tests.fixtures.left_behind import hydra_held, hydra_held_code
from tests.fixtures.mpi import REPO_ROOT, clean_environ, run_mpi
from tests.fixtures.requirements import missing

pytestmark = pytest.mark.mpi


def _two_ranks(tmp_path, name: str, *args: str):
    """``python -m benchmarks.NAME ARGS`` on 2 ranks: the run, ended well, and its JSON."""
    out = tmp_path / f"{name}.json"
    result = run_mpi(2, ["-m", f"benchmarks.{name}", *args, "--json", str(out)], timeout=300)
    assert result.returncode == 0, result.output
    return result, json.loads(out.read_text())


SAMPLE_BEFORE = """
import json, time
from benchmarks import timing
order = []
def before():
    order.append("before")
    time.sleep(0.05)
times = timing.sample(lambda: order.append("op"), 3, before)
plain = timing.sample(lambda: order.append("plain"), 2)
assert timing.evictor(0) is None
timing.evictor(1)()
print(json.dumps({"order": order, "times": [*times, *plain]}))
"""


def test_what_runs_before_each_timed_call_is_not_timed():
    """``--evict-mib``'s writes (``timing.sample``'s ``before``) run before every call, outside
    its time: a 50 ms ``before`` leaves each call's time far below 50 ms."""
    result = run_mpi(1, ["-c", SAMPLE_BEFORE], timeout=60)
    assert result.returncode == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["order"] == ["before", "op"] * 3 + ["plain"] * 2
    assert max(report["times"]) < 0.025, report


PAIRED = """
import argparse, json, time
from benchmarks import timing
def spin(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass
START = time.perf_counter()
def speed():  # the machine: slower by the second, 1x at the start, 3x half a second later
    return 1.0 + 4.0 * (time.perf_counter() - START)
ops = {"raw": lambda: spin(0.0005 * speed()),
       "slower": lambda: spin(0.0005 * speed() + 0.0003)}
stats = timing.paired(ops, argparse.Namespace(seconds=0.5, max_calls=400))
print(json.dumps(stats, default=list))
"""


def test_paired_timing_recovers_a_difference_while_the_machine_changes_speed():
    """``timing.paired``: the median of each turn's difference is the 0.3 ms between the two
    ops, though the machine slows down as they run: calls that take turns one by one see it
    alike. Timed one op after the other, the later one would look slower by ~0.5 ms more."""
    result = run_mpi(1, ["-c", PAIRED], timeout=60)
    assert result.returncode == 0, result.output
    stats = json.loads(result.stdout.strip().splitlines()[-1])
    assert stats["raw"]["minus_base"] == 0 and stats["raw"]["calls"] >= 5
    assert stats["slower"]["minus_base"] == pytest.approx(0.0003, abs=0.00005), stats
    assert stats["slower"]["best"] >= 0.0008
    assert len(stats["raw"]["times"]) == stats["raw"]["calls"]


def test_allreduce_benchmark_writes_every_table(tmp_path):
    result, report = _two_ranks(tmp_path, "allreduce", "--seconds", "0.02", "--rounds", "1",
                                "--busy-calls", "20", "--evict-mib", "1")
    assert report["evict_mib"] == 1 and "after 1 MiB of other memory written" in result.output
    assert [row["bytes"] for row in report["allreduce"]] == [4 << 10 << 2 * i for i in range(8)]
    floor = report["floor"]
    assert 0 < floor["link_median_GBps"] <= floor["link_GBps"] and floor["memcpy_GBps"] > 0
    assert floor["exchange_GBps"] > 0
    for row in report["allreduce"]:
        assert row["vs_raw_median"] > 0 and row["vs_gloo_median"] > 0
        # 2 ranks: busbw = algbw x 2(n-1)/n = algbw, and the floor moves the whole buffer
        assert row["mpi4py_median_busGBps"] == pytest.approx(row["mpi4py_median_GBps"])
        assert row["floor_us"] == pytest.approx(row["bytes"] / floor["link_GBps"] / 1e3)
        assert row["mpi4py_vs_exchange_median"] == pytest.approx(
            row["mpi4py_median_busGBps"] / floor["exchange_GBps"])
    # the plot beside the JSON (matplotlib is in the dev extra)
    assert (tmp_path / "allreduce.png").read_bytes().startswith(b"\x89PNG")
    busy = report["busy_allreduce_after_last_arrival_us"]
    cxx = {"mpi_cxx"} if mpi_cxx.built_path().exists() else set()
    # beside the compiled backend, each layer alone: torch's front end, MPI's parts; and the
    # backend with the code path warmed
    layers = ({"front_end", "raw_after_front_end", "raw_nonblocking", "raw_self",
               "mpi_cxx_warmed"} if cxx else set())
    assert set(busy) == {"mpi4py", "gloo", "raw"} | cxx | layers
    # the ping-pong also times the compiled backend's ProcessGroup without torch's dist.send
    assert set(report["pingpong_half_round_trip_us"]) == (
        {"mpi4py", "gloo", "raw"} | cxx | {f"{n}_pg" for n in cxx})
    assert set(report["pingpong_vs_raw"]) == set(report["pingpong_half_round_trip_us"])
    assert report["pingpong_vs_raw"]["raw"] == 1.0
    for row in report["allreduce"]:
        assert ("mpi_cxx_vs_mpi4py_median" in row) == bool(cxx)
        assert ("front_end_goal_met" in row) == bool(cxx)
        if cxx:  # timing orders are the benchmark's to report: only what derives from them
            assert row["goal_turns"] >= 5
            for name in ("front_end", "front_end_in_turn"):
                assert 0 < row[f"{name}_best_us"] <= row[f"{name}_median_us"]
                assert row[f"{name}_goal_met"] == (
                    row["mpi_cxx_minus_raw_median_us"] <= row[f"{name}_median_us"] + 1.0)
            assert "nonblocking_minus_raw_median_us" in row
            assert row["mpi_cxx_vs_mpi4py_in_turn"] > 0
    for stats in busy.values():
        assert 0 < stats["best"] <= stats["median"] <= stats["p90"]
    assert "between rounds of compute" in result.stdout


def test_ddp_step_benchmark_times_each_backend_beside_compute_alone(tmp_path):
    result, report = _two_ranks(tmp_path, "ddp_step", "--seconds", "0.2", "--rounds", "1",
                                "--max-calls", "3")
    steps = report["step_ms"]
    cxx = {"mpi_cxx"} if mpi_cxx.built_path().exists() else set()
    assert set(steps) == {"compute", "serial", "ddp alone", "mpi4py", "gloo"} | cxx
    assert all(0 < s["best"] <= s["median"] for s in steps.values())
    assert "communication not hidden" in result.stdout
    backend = report["serial_backend"]
    assert backend == ("mpi_cxx" if cxx else "mpi4py")
    assert report["hidden_ms"]["best"] == pytest.approx(
        steps["serial"]["best"] + steps["ddp alone"]["best"] - steps["compute"]["best"]
        - steps[backend]["best"])


def test_huge_pages_benchmark_puts_each_kind_of_page_beside_4_kib_ones(tmp_path):
    result, report = _two_ranks(tmp_path, "huge_pages", "--seconds", "0.05", "--rounds", "1",
                                "--sizes", "8")
    assert report["torch_takes_huge_pages"] is True  # set before torch's first allocation
    [row] = report["allreduce"]
    assert row["bytes"] == 8 << 20 and row["small_huge_backed_bytes"] == 0  # each its own
    if report["transparent_hugepage"] in ("madvise", "always"):  # as many as free ones allow
        # none only where the kernel had none free: then it counted its fallbacks
        assert (0 < row["huge_huge_backed_bytes"] <= 8 << 20
                or row["huge_huge_fallbacks"] > 0), row
    cxx = ["mpi_cxx"] if mpi_cxx.built_path().exists() else []
    for name in [*cxx, "mpi4py", "gloo", "raw"]:
        for pages in ("huge", "torch"):
            assert row[f"{name}_{pages}_speedup_median"] == pytest.approx(
                row[f"{name}_small_median_us"] / row[f"{name}_{pages}_median_us"])
    assert "huge MiB: all, torch's" in result.stdout
    assert (tmp_path / "huge_pages.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.skipif(not mpi_cxx.built_path().exists(), reason="the compiled backend is not "
                    "built: .venv/bin/python -m launcher.mpi.cxx")
def test_allreduce_layers_puts_each_layer_beside_raw_mpi(tmp_path):
    result, report = _two_ranks(tmp_path, "allreduce_layers", "--seconds", "0.05", "--rounds",
                                "1", "--sizes", "16,64")
    assert [row["bytes"] for row in report["layers"]] == [16 << 10, 64 << 10]
    for row in report["layers"]:
        assert row["raw_minus_raw_median_us"] == 0
        assert row["turns"] >= 5
        for name in ("nonblocking", "backend", "process_group", "dist"):
            assert 0 < row[f"{name}_best_us"] <= row[f"{name}_median_us"]
            assert f"{name}_minus_raw_median_us" in row
        # the goal's yardstick: its own times, warm and in the turns, not layers above raw
        for name in ("front_end", "front_end_in_turn"):
            assert 0 < row[f"{name}_best_us"] <= row[f"{name}_median_us"]
            assert f"{name}_minus_raw_median_us" not in row
    assert "process_group" in result.stdout and "front_end_in_turn" in result.stdout
    assert (tmp_path / "allreduce_layers.png").read_bytes().startswith(b"\x89PNG")


def test_train_scaling_benchmark_splits_weak_scaling_and_measures_the_broadcast(tmp_path):
    """One round for real; the rounds and their medians: the next test."""
    out = tmp_path / "train_scaling.json"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.train_scaling", "--weak-only", "--steps", "15",
         "--repeats", "1", "--json", str(out)],
        cwd=REPO_ROOT, env=clean_environ(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert [(w["repeat"], w["backend"]) for w in report["weak"]] == [(0, "gloo"), (0, "mpi")]
    for w in report["weak"]:
        assert w["efficiency"] == pytest.approx(w["machine_efficiency"] * w["sync_efficiency"])
        assert w["rate_1"] > 0 and w["rate_2"] > 0 and w["rate_2_independent"] > 0
        assert w["bcast_efficiency"] == pytest.approx(w["rate_2_bcast"] / (2 * w["rate_1"]))
    # one rank, the control (two single-rank runs), per backend two ranks without and with
    # buffers broadcast every step
    assert sorted(r["ranks"] for r in report["runs"]) == [1] * 3 + [2] * 4
    assert sum(r["model"] == "cnn" for r in report["runs"]) == 5
    assert set(report["weak_step_breakdown"]) == {"1 rank", "2 ranks gloo", "2 ranks mpi"}
    assert "= machine" in result.stdout and "Where a step goes" in result.stdout
    assert out.with_suffix(".png").read_bytes().startswith(b"\x89PNG")


class FakeRuns:
    """``train_scaling.Runs`` without the jobs: samples/s from a table, one entry per call."""

    def __init__(self, rates: dict[tuple, list[float]]):
        self.rates, self.calls = {k: list(v) for k, v in rates.items()}, []

    def one(self, ranks, backend, model, batch, sync="ddp") -> dict:
        self.calls.append((ranks, backend, model))
        rate = self.rates[(ranks, backend, model)].pop(0)
        return {"samples_per_s": rate, **{k: 1 / rate for k in (
            "t_step", "t_forward", "t_backward", "t_comm", "t_optimizer")}}

    def side_by_side(self, model, batch) -> float:
        self.calls.append("apart")
        return self.rates["apart"].pop(0)


def test_train_scaling_rounds_take_every_run_in_turn_and_the_median_counts():
    runs = FakeRuns({(1, "gloo", "cnn"): [100, 100, 50], "apart": [180, 180, 90],
                     (2, "gloo", "cnn"): [160, 120, 60], (2, "mpi", "cnn"): [150, 150, 100],
                     (2, "gloo", train_scaling.CNN_BROADCASTING): [80] * 3,
                     (2, "mpi", train_scaling.CNN_BROADCASTING): [80] * 3})
    report = train_scaling.weak_scaling(runs, ["gloo", "mpi"], 3)
    # whole rounds one after another: a drift of the machine's speed falls on every run alike
    one_round = [(1, "gloo", "cnn"), "apart", (2, "gloo", "cnn"),
                 (2, "gloo", train_scaling.CNN_BROADCASTING), (2, "mpi", "cnn"),
                 (2, "mpi", train_scaling.CNN_BROADCASTING)]
    assert runs.calls == one_round * 3
    assert [(w["repeat"], w["backend"]) for w in report["weak"]] == [
        (r, b) for r in range(3) for b in ("gloo", "mpi")]
    gloo = report["weak_summary"]["gloo"]
    # efficiencies 0.8, 0.6, 0.6: the median is not the mean, and the range is kept
    assert gloo["median_efficiency"] == pytest.approx(0.6)
    assert (gloo["min_efficiency"], gloo["max_efficiency"]) == pytest.approx((0.6, 0.8))
    assert report["weak_summary"]["mpi"]["median_efficiency"] == pytest.approx(0.75)
    assert report["weak_step_breakdown"]["1 rank"]["t_step"] == pytest.approx(1 / 100)


@pytest.mark.runtime
def test_container_cost_benchmark_compares_venv_and_ch_run(ch_image, tmp_path):
    out = tmp_path / "container_cost.json"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.container_cost", "--image", str(ch_image), "--rounds",
         "1", "--calls", "5", "--json", str(out)],
        cwd=REPO_ROOT, env=clean_environ(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    names = {"venv, mpiexec", "ch-run, mpiexec", "ch-run without --join, mpiexec"}
    assert set(report["median_s"]) == names
    for times in report["median_s"].values():
        assert set(times) == {str(1 << 20), str(16 << 20)} and min(times.values()) > 0
    median = report["median_s"]
    assert report["ratio_venv_over"] == {
        name: {size: median["venv, mpiexec"][size] / median[name][size] for size in median[name]}
        for name in ("ch-run, mpiexec", "ch-run without --join, mpiexec")}
    # the container lines are invoke run's: --join-ct for the node's 2 ranks
    assert "ch-run --join-ct=2 " in report["commands"]["ch-run, mpiexec"]
    assert out.with_suffix(".png").stat().st_size > 0
    assert "1.00x = no cost" in result.stdout


def test_imb_takes_turns_with_the_allreduce_benchmark(impi_prefix, tmp_path):
    """One round for real (IMB's job, then ours); the median over rounds: the next test."""
    out = tmp_path / "imb.json"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.imb", "--prefix", str(impi_prefix), "--rounds", "1",
         "--iterations", "5", "--allreduce-args", "--seconds 0.02 --rounds 1 --busy-calls 20",
         "--json", str(out)],
        cwd=REPO_ROOT, env=clean_environ(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [row["bytes"] for row in rows] == [4 << 10 << 2 * i for i in range(8)]
    for row in rows:
        assert row["rounds"] == 1 and row["imb_us"] > 0 and row["mpi4py_median_us"] > 0
    assert "IMB-MPI1 Allreduce (Intel MPI, 2 ranks, one node)" in result.stdout


def test_imb_rows_take_the_median_of_each_rounds_ratio():
    def run(ours_us: float, imb_us: float) -> tuple[dict, dict[int, float]]:
        allreduce = {"allreduce": [{"bytes": 4096, "mpi4py_median_us": ours_us,
                                    "raw_median_us": 1.0},
                                   {"bytes": 3, "mpi4py_median_us": 1.0, "raw_median_us": 1.0}]}
        return allreduce, {4096: imb_us, 8192: 1.0}  # IMB has no 3 B; 8 KiB is not ours

    [row] = imb.compare([run(10.0, 20.0), run(40.0, 40.0), run(20.0, 80.0)])
    # ratios 2, 1, 4 in the rounds: their median, not the ratio of the medians (40 / 20)
    assert row == {"bytes": 4096, "rounds": 3, "imb_us": 40.0, "mpi4py_median_us": 20.0,
                   "raw_median_us": 1.0, "imb_vs_mpi4py": 2.0}


def test_tuning_benchmark_compares_each_variant_with_the_first(tmp_path):
    out = tmp_path / "tuning.json"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.tuning", "--rounds", "1", "--seconds", "0.02",
         "--job-timeout", "200", "--json", str(out)],
        cwd=REPO_ROOT, env=clean_environ(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    first, ring = report["busGBps"]  # MPICH's own choice, then its ring
    assert len(report["busGBps"][ring]) == 8 and min(report["busGBps"][ring].values()) > 0
    assert set(report["vs_first"][first].values()) == {1.0}


def test_a_tuning_job_that_does_not_end_is_named_not_waited_for():
    with pytest.raises(SystemExit, match="no end after 0 s: sleep 30"):
        tuning.run_job(["sleep", "30"], job_timeout=0.3)


@pytest.mark.mpi
def test_a_rank_side_error_ends_the_whole_job(tmp_path):
    """Rank 0 fails while rank 1 waits for it: MPI_Abort ends both, not MPI_Finalize's wait,
    and Hydra's topology file goes with them (``test_fail_fast`` says why)."""
    code = ("from mpi4py import MPI; from benchmarks import rank_side; "
            "from launcher.mpi import segments; segments.unlink_mapped(MPI.COMM_WORLD); "
            + hydra_held_code(tmp_path) + "rank_side.end_job_on_error(); "
            "MPI.COMM_WORLD.Barrier(); MPI.COMM_WORLD.rank == 0 and 1 / 0; "
            "MPI.COMM_WORLD.Barrier()")
    result = run_mpi(2, ["-c", code], timeout=60, cwd=REPO_ROOT)
    assert result.returncode != 0 and "ZeroDivisionError" in result.output
    assert "MPI_Abort" in result.output
    held = hydra_held(tmp_path)
    assert held and not any(os.path.exists(path) for path in held), held


@pytest.mark.cluster
@pytest.mark.docker
def test_the_rank_side_benchmarks_start_as_modules_across_compose_nodes(compose_mpi):
    """The image holds no benchmarks/: the package goes to the shared volume and every node's
    rank runs ``python -m benchmarks.NAME`` from there (allreduce, a tuning variant)."""
    report = cluster_benchmark.allreduce(compose_mpi.prefix, 2, (
        "--seconds", "0.02", "--rounds", "1", "--busy-calls", "5"))
    assert report["world_size"] == 2 and report["nodes"] == 2
    assert [row["bytes"] for row in report["allreduce"]] == [4 << 10 << 2 * i for i in range(8)]
    launch, script = tuning.on_cluster(compose_mpi.container("node0"),
                                       list(compose_mpi.hosts[:2]))
    [(label, _)] = variants = tuning.VARIANTS[:1]
    result = tuning.compare(launch, script, variants, 1, 0.02)
    assert len(result["busGBps"][label]) == 8 and min(result["busGBps"][label].values()) > 0


def test_flight_recorder_benchmark_puts_before_and_with_beside_without(tmp_path):
    """One round, the recorder of HEAD as "before" (read from git, its ddp_steps bound to it)."""
    out = tmp_path / "flight_recorder.json"
    result = subprocess.run([sys.executable, "-m", "benchmarks.flight_recorder", "--rounds", "1",
                             "--before", "HEAD", "--json", str(out)], capture_output=True,
                            text=True, timeout=300, env=clean_environ(), cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    rows = {row["measure"]: row for row in report["results"]}
    assert list(rows)[:4] == ["wrapper", "all_reduce 4 KiB", "step", "step, torch's hook"]
    assert all(row[f"{mode}_us"] > 0 for row in rows.values()
               for mode in ("without", "before", "with"))
    # the wrapper around a function that does nothing is all recorder: never free
    assert rows["wrapper"]["with_us"] > rows["wrapper"]["without_us"]
    assert rows["wrapper"]["before_us"] > rows["wrapper"]["without_us"]
    # counted, not timed: a step with the recorder calls more Python functions, as many as HEAD's
    assert rows["step"]["with_calls"][0] > rows["step"]["without_calls"][0]
    assert rows["step"]["with_calls"] == rows["step"]["before_calls"]
    assert "with +us" in result.stdout


def test_recorder_instructions_counts_the_measured_calls_alone(tmp_path):
    """The wrapper alone, under callgrind for real: the dump read is the calls' own (a Python
    call of a function that does nothing: hundreds of instructions, not the import's
    billions), and the recorder adds to it."""
    if shutil.which("valgrind") is None:
        missing("valgrind is not installed (Debian: apt-get install valgrind)")
    out = tmp_path / "instructions.json"
    result = subprocess.run([sys.executable, "-m", "benchmarks.recorder_instructions", "--only",
                             "wrapper", "--steps", "1", "--rounds", "1", "--json", str(out)],
                            capture_output=True, text=True, timeout=600, env=clean_environ(),
                            cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    [row] = json.loads(out.read_text())["results"]
    counted = row["instructions"]
    assert row["measure"] == "wrapper" and row["calls"] == 200 and "cycles" not in row
    assert 100 < counted["without"] < 20_000, counted
    assert counted["with"] > counted["without"] + 1_000, counted
    assert "A/A %" in result.stdout


def test_recorder_instructions_reads_callgrind_dumps_and_estimates_cycles(tmp_path):
    """Per op, the median over rounds; the cycle estimate KCachegrind's (Ir + 10 Bm + 10 L1m +
    100 LLm) where the caches were simulated."""
    events = "Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw Bc Bcm Bi Bim"
    dumps = {}
    for name, ir in (("w1", 1000), ("w2", 3000), ("r1", 1500), ("r2", 4500), ("a1", 1000),
                     ("a2", 3000)):
        dumps[name] = tmp_path / name
        dumps[name].write_text(f"version: 1\nevents: {events}\nfn=x\n0 {ir}\n"
                               f"summary: {ir} 0 0 1 1 1 1 0 0 0 1 0 1\n")
    counts = recorder_instructions.totals(dumps["w1"])
    assert counts["Ir"] == 1000 and counts["Bim"] == 1
    assert recorder_instructions.cycles(counts) == 1000 + 10 * 2 + 10 * 3 + 100 * 1
    assert recorder_instructions.cycles({"Ir": 5}) is None
    runs = {"step": {"calls": 10, "without": [str(dumps["w1"]), str(dumps["w2"])],
                     "with": [str(dumps["r1"]), str(dumps["r2"])],
                     "without, again": [str(dumps["a1"]), str(dumps["a2"])]}}
    [row] = recorder_instructions.rows(runs)
    assert row["instructions"] == {
        "without": 200.0, "with": 300.0, "added": 100.0, "added_pct": 50.0, "a_a_pct": 0.0,
        "rounds": {"without": [100.0, 300.0], "with": [150.0, 450.0],
                   "without, again": [100.0, 300.0]}}
    assert row["cycles"]["without"] == 200.0 + 15.0
    # outside callgrind no dump appears: one error line and its hint, not a table of nothing
    with pytest.raises(SystemExit, match=r"(?s)^error: callgrind wrote 0 dumps.*\nHINT: "):
        recorder_instructions.run_counted(lambda: None, 3, tmp_path)


def test_checkpoint_benchmark_saves_and_loads_each_model(tmp_path):
    out = tmp_path / "checkpoint.json"
    result = subprocess.run([sys.executable, "-m", "benchmarks.checkpoint", "--rounds", "1",
                             "--json", str(out)], capture_output=True, text=True, timeout=300,
                            env=clean_environ(), cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    rows = json.loads(out.read_text())["results"]
    assert [row["model"] for row in rows] == ["mlp", "autoencoder", "cnn"]
    assert all(row["bytes"] > 4 * row["parameters"] and row["save_ms"] > 0 and row["load_ms"] > 0
               for row in rows)


def test_binding_benchmark_compares_none_and_auto(tmp_path):
    out = tmp_path / "binding.json"
    result = subprocess.run([sys.executable, "-m", "benchmarks.binding", "--rounds", "1",
                             "--steps", "6", "--json", str(out)], capture_output=True,
                            text=True, env=clean_environ(), cwd=REPO_ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert [(row["ranks"], row["mode"]) for row in report["rows"]] == [(2, "none"), (2, "auto")]
    assert all(row["median"] > 0 for row in report["rows"]) and report["host"]["numa_nodes"]
    assert result.stdout.splitlines()[0].split() == ["ranks", "--bind", "samples/s", "vs",
                                                     "none", "rounds"]
    assert out.with_suffix(".png").stat().st_size > 0


def test_control_plane_benchmark_puts_the_three_designs_side_by_side(tmp_path):
    out = tmp_path / "control-plane.json"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.control_plane", "--ranks", "4", "8", "--seconds",
         "2", "--json", str(out)], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    rows = json.loads(out.read_text())["rows"]
    designs = ("all-to-all", "store watch", "peer to peer")
    measured = {(row["design"], row["ranks"]) for row in rows if not row.get("modelled")}
    assert measured == {(design, size) for design in designs for size in (4, 8)}
    by = {(row["design"], row["ranks"]): row for row in rows}
    # all-to-all every rank reads every key; the watch a handful; peer to peer none
    assert by["all-to-all", 100_000]["store_keys_per_s"] > 1e9
    assert by["store watch", 100_000]["store_keys_per_s"] < 1e6
    assert by["peer to peer", 8]["store_keys_per_s"] == 0
    assert by["store watch", 8]["store_connections"] == 16  # 2 per rank
    assert by["all-to-all", 8]["store_connections"] == 24  # 3 per rank
    # peer to peer the store keeps the rendezvous' connections alone, and the busiest
    # process takes the same few messages per second at every size
    assert by["peer to peer", 8]["store_connections"] == 8
    assert by["peer to peer", 100_000]["busiest_messages_per_s"] < 10
    assert 0 < by["peer to peer", 8]["notice_s"] < 5
    assert by["peer to peer", 8]["beats_done"] > 0.5
    assert out.with_suffix(".png").exists()
    assert "peer to peer" in result.stdout
