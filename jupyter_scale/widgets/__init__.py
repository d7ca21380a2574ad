"""The live dashboard under a %%distribute cell (anywidget: one JS file, no build)."""

from .dashboard import Dashboard, DashboardFeed, snapshot_html

__all__ = ["Dashboard", "DashboardFeed", "snapshot_html"]
