"""Start-up time of an 8-rank CPU world (fork after imports), as a pytest-benchmark measurement."""

import pytest

from harness.process.dist import World


@pytest.mark.bench
def test_eight_rank_cpu_world_spin_up(benchmark):
    def start_and_close():
        world = World(8).start()
        startup = world.startup_s
        world.close()
        return startup

    startup = benchmark.pedantic(start_and_close, rounds=3, iterations=1)
    print(f"\n8-rank gloo world (fork after imports): started in {startup * 1000:.0f} ms")
