"""What the planner tests share: the vendored PipeDream profiles and the V100 cluster they are planned on
(the fixtures vgg, gnmt and vgg_plan are in conftest.py)."""

from pathlib import Path

PROFILES = Path(__file__).resolve().parent / "data" / "pipedream"  # vendored PipeDream profiles (MIT)
V100_CLUSTER = "4x4,16GB,100Gbit"  # 4 nodes x 4 V100 16 GB, 12.5e9 B/s between nodes, 100 GB/s inside


def need_profiles(test):
    """Marks a test that reads the vendored profiles (they ship with the tests: it never skips)."""
    return test
