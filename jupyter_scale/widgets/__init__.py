"""The live dashboard under a %%distribute cell (anywidget: one JS file, no build)."""

from .dashboard import PALETTE, Dashboard, DashboardFeed, snapshot_html

__all__ = ["PALETTE", "Dashboard", "DashboardFeed", "snapshot_html"]
