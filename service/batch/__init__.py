"""`kimi-vision batch`: caption, OCR or embed many images with progress and exactly-once resume.

- `inputs`: directory / OpenAI-batch JSONL / path list -> `Item`s with unique `custom_id`s.
- `journal`: the output JSONL (whole-line appends), the job fingerprint, resume.
- `shards`: embedding safetensors shards beside the output.
- `backends`: the engine in this process, or a server over gRPC.
- `runner`: the job (`JobSpec`, `ItemRunner`, `Job`, rows, `Summary`); `progress`: bar or log lines.
- `ray_engine`: the same items and rows on Ray Data, an engine in each actor.
"""
