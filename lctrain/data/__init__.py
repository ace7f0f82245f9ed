"""Data: the sources a config names and their checks (sources), ingestion and preprocessing into
token shards (ingest, preprocess, encoding, shards), packing with document borders (packing), the
resumable dp x cp loader (loader, batch), and the built-in synthetic source and long-context
tasks (synthetic, tasks).

Nothing is imported here, so that `lctrain preprocess` never pays for torch."""
