"""Grouped bar charts for the benchmarks' PNGs (matplotlib, Agg; a no-op where it is missing)."""

from __future__ import annotations


def grouped_bars(path: str, groups: list[str], series: dict[str, list[float]], ylabel: str, title: str,
                 figsize=(9, 4), rotate: int = 0, legend_size: int = 7) -> bool:
  """One bar per (group, series) value, series side by side within each group; False without matplotlib."""
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError:
    return False
  fig, ax = plt.subplots(figsize=figsize)
  width = 0.8 / max(len(series), 1)
  for i, (name, values) in enumerate(series.items()):
    ax.bar([j + i * width for j in range(len(groups))], values, width, label=name)
  ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))], groups, rotation=rotate,
                fontsize=7 if rotate else None)
  ax.set_ylabel(ylabel)
  ax.set_title(title)
  ax.legend(fontsize=legend_size, ncol=2)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True
