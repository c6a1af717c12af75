"""Plotly figures of timelines and memory, shared by the notebook dashboard and the command line. No widgets."""
