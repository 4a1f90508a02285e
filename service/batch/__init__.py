"""`kimi-vision batch`: caption, OCR or embed many images with progress and exactly-once resume,
reading and writing the OpenAI Batch format.

- `spec`: what a job computes (`JobSpec`) and its fingerprint.
- `inputs`: OpenAI-batch JSONL / directory / path list -> `Item`s (one per line, in input order, read lazily).
- `ids`: `IdTable`, custom_ids as 128-bit hashes (repeated ids, resume).
- `requests`: an item's request, checked (the envelope, a chat-completions or embeddings body).
- `rows`: the output line (OpenAI Batch output shape, as vLLM's `run_batch` writes it).
- `journal`: the output JSONL (whole-line appends), the fingerprint, resume, the final input order.
- `shards`: embedding safetensors shards beside the output.
- `backends`: the engine in-process, or a server over gRPC.
- `runner`: `ItemRunner` (a line -> its row), `Recorder`, `Job`, `Summary`; `progress`: bar or log lines.
- `ray_engine`: the same lines and rows on Ray, an engine in each actor.
"""
