"""Pure primitives of the parallel layout, used by every layer above: rank <-> coordinate math
(topology), the context-parallel sequence split (sequence), and collectives that count the
traffic they send (comm)."""
