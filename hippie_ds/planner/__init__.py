"""The Hippie pipeline planner: profiles, clusters, partitions, re-computation, plans. Pure
Python (no torch): ``hippie-ds plan`` on the command line, :func:`make_plan` in code."""

from .cluster import Cluster, ClusterError, load_cluster, parse_cluster
from .objectives import OBJECTIVES, Figures, register_objective
from .plan import make_plan
from .plan_file import SCHEDULES, Baseline, Plan, PlanMismatchError, Prediction, StagePlan, load_plan, save_plan
from .plan_summary import format_summary
from .pipedream_profile import read_pipedream
from .profile import LayerProfile, PlannerError, Profile, ProfileError, save_profile, synthetic_profile
from .profile_io import load_profile

__all__ = [
    "Baseline",
    "Cluster",
    "ClusterError",
    "Figures",
    "LayerProfile",
    "OBJECTIVES",
    "Plan",
    "PlanMismatchError",
    "PlannerError",
    "Prediction",
    "Profile",
    "ProfileError",
    "SCHEDULES",
    "StagePlan",
    "format_summary",
    "load_cluster",
    "load_plan",
    "load_profile",
    "make_plan",
    "parse_cluster",
    "read_pipedream",
    "register_objective",
    "save_plan",
    "save_profile",
    "synthetic_profile",
]
