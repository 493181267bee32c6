"""Offline tools: model shapes, FLOPs/MFU, trace breakdown, run reports, the HBM plan."""
