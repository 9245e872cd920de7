"""``hetflow bench soak``'s window mode (``window`` > 0 in its config): a steady stream that
keeps at most ``window`` tasks in flight, so the client's memory stays flat over 100,000
tasks. Here at small scale, counting the tasks in flight at every submission."""
import threading

import pytest

pytestmark = pytest.mark.timeout(120)


def counted_run(n: int, window: int) -> tuple:
    """``throughput.measure`` on the pool (1-rank no-op tasks, 2 slots); its result, and the
    peak and final count of tasks submitted and not yet delivered, and how many were submitted."""
    from hetflow.experiments import throughput

    lock = threading.Lock()
    flight = {"now": 0, "peak": 0, "submitted": 0}

    def landed(_future):
        with lock:
            flight["now"] -= 1

    with throughput.session("pool", 1, 2) as submit:
        def counted():
            with lock:
                flight["now"] += 1
                flight["submitted"] += 1
                flight["peak"] = max(flight["peak"], flight["now"])
            future = submit()
            future.add_done_callback(landed)   # before measure's own, which frees the window
            return future

        result = throughput.measure(counted, n, window=window)
    return result, flight


def test_window_mode_never_has_more_than_the_window_in_flight():
    result, flight = counted_run(400, window=8)
    assert result["lost"] == 0 and result["errors"] == [], result
    assert flight == {"now": 0, "peak": 8, "submitted": 401}   # the warm-up task, then 400
    # all at once (no window), for contrast: the count is what the window bounds
    result, flight = counted_run(100, window=0)
    assert result["lost"] == 0 and flight["peak"] > 8, flight
