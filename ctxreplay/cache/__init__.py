"""The persistent capture cache: a directory of captured programs (never
their weights) and their verification records, keyed by everything that can
change a variant's graph, so a later ``finalize()`` of an unchanged model
loads and checks each variant instead of tracing it again."""
