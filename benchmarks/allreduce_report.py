"""The tables benchmarks/allreduce.py prints on rank 0: the sizes, the compiled backend
against torch's front end, the all_reduce between rounds of compute."""

from __future__ import annotations

from benchmarks.timing import COMM
from benchmarks.units import human


def print_table(rows: list[dict], contenders: tuple[str, ...], limits: dict) -> None:
    """The sizes' table (and the front end's, where the compiled backend ran)."""
    print(f"floor: link {limits['link_GBps']:.2f} GB/s one way (64 MiB ping-pong, ranks 0-1), "
          f"{limits['exchange_GBps']:.2f} GB/s each while all ranks exchange at once (64 MiB "
          f"Sendrecv in a ring), memcpy {limits['memcpy_GBps']:.2f} GB/s (one core)")
    print(f"all_reduce float32, {COMM.size} ranks: median (best) microseconds per call, "
          f"bus GB/s of the median")
    cxx = "mpi_cxx" in contenders
    header = (f"{'size':>6} | {'floor us':>8} | "
              + " | ".join(f"{n:>17} {'busbw':>5}" for n in contenders) + " | "
              f"{'vs link':>7} | {'vs exch':>7} | {'vs raw':>11} | {'vs gloo':>13}"
              + (f" | {'cxx vs raw':>11} | {'cxx vs py':>11}" if cxx else ""))
    print(header)
    print("-" * len(header))
    for r in rows:
        cells = [f"{r[f'{n}_median_us']:>8.1f} ({r[f'{n}_best_us']:>6.1f}) "
                 f"{r[f'{n}_median_busGBps']:>5.2f}" for n in contenders]
        print(f"{human(r['bytes']):>6} | {r['floor_us']:>8.1f} | " + " | ".join(cells)
              + f" | {r['mpi4py_vs_link_median']:>7.2f}"
              + f" | {r['mpi4py_vs_exchange_median']:>7.2f}"
              + f" | {r['vs_raw_median']:>4.2f} ({r['vs_raw_best']:>4.2f})"
              + f" | {r['vs_gloo_median']:>5.1f}x ({r['vs_gloo_best']:>4.1f}x)"
              + (f" | {r['mpi_cxx_vs_raw_median']:>4.2f} ({r['mpi_cxx_vs_raw_best']:>4.2f})"
                 f" | {r['mpi_cxx_vs_mpi4py_median']:>4.2f} ({r['mpi_cxx_vs_mpi4py_best']:>4.2f})"
                 if cxx else ""))
    print("vs link = mpi4py busbw / link (1.0 = at the floor); vs exch = mpi4py busbw / the "
          "exchange's bandwidth; vs raw = raw time / mpi4py time "
          "(1.0 = as fast as raw mpi4py); vs gloo = gloo time / mpi4py time (> 1 = faster); "
          "cxx vs raw, cxx vs py: the same for mpi_cxx against raw and against mpi4py")
    if rows and "front_end_median_us" in rows[0]:
        print_front_end(rows)


def print_busy(busy: dict, nbytes: int) -> None:
    print(f"\nall_reduce of {human(nbytes)} between rounds of compute, from the last rank's "
          "arrival, us: mean, median, p90, best (front_end: on a group of one; raw_self: MPI "
          "on one rank; mpi_cxx_warmed: after an untimed front_end call; raw_after_front_end: "
          "a front_end call then raw, timed as one)")
    for n in busy:
        print(f"{n:>15}: " + " ".join(f"{busy[n][k] * 1e6:8.1f}"
                                      for k in ("mean", "median", "p90", "best")))


def print_front_end(rows: list[dict]) -> None:
    print("\nissue 37's goal: mpi_cxx - raw <= torch's front end (dist.all_reduce on a group of "
          "one) + 1 us. mpi_cxx - raw and MPI's part (its non-blocking all_reduce polled to its "
          "end - raw): medians of differences within turns of calls; the front end: median "
          "(best) us, alone (call after call) and in turn (after the turn's MPI calls); vs Python "
          "backend: the median of the turns' mpi4py time / mpi_cxx time (goal >= 1)")

    def met(r, key):
        return "met" if r[f"{key}_goal_met"] else "not met"
    for r in rows:
        print(f"{human(r['bytes']):>7} | mpi_cxx - raw {r['mpi_cxx_minus_raw_median_us']:>7.1f} | "
              f"front end alone {r['front_end_median_us']:>5.1f} ({r['front_end_best_us']:>5.1f})"
              f" {met(r, 'front_end'):>7} | in turn {r['front_end_in_turn_median_us']:>6.1f} "
              f"({r['front_end_in_turn_best_us']:>5.1f}) {met(r, 'front_end_in_turn'):>7} | "
              f"MPI's part {r['nonblocking_minus_raw_median_us']:>6.1f} | vs Python backend "
              f"{r['mpi_cxx_vs_mpi4py_in_turn']:.2f} | {r['goal_turns']} turns")
