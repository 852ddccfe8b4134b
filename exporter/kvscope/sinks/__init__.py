"""kvscope.sinks: where rows go (ClickHouse, the decision log, Loki), behind one interface."""
