"""kvscope's Grafana dashboards, built with grafana-foundation-sdk (``generate`` writes json/)."""
