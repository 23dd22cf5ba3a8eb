"""The session on Ray: connect, actors for training and sampling, placement, jobs.

    from workbench.cluster import connect, create_ray_session
    connect("local", num_cpus=2)
    session = create_ray_session(SessionSpec("tiny", cluster=ClusterSpec("local", num_workers=2)))

Everything here imports without Ray; Ray is imported when a function needs it (and a missing
Ray raises an ImportError naming `pip install 'workbench[ray]'`).
"""

from workbench.cluster.connect import connect, disconnect
from workbench.cluster.ray_session import create_ray_session

__all__ = ["connect", "create_ray_session", "disconnect"]
