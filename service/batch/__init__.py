"""`kimi-vision batch`: caption, OCR or embed many images with progress and exactly-once resume.

- `inputs`: directory / OpenAI-batch JSONL / path list -> `Item`s with unique `custom_id`s.
- `journal`: the output JSONL (whole-line appends), the job fingerprint, resume.
- `shards`: embedding safetensors shards beside the output.
- `backends`: in-process engine, bare encoder pool, or a server over gRPC.
- `runner`: the job (`JobSpec`, `Job`, rows, `Summary`); `progress`: bar or log lines.

The Ray Data engine is `service.batch_ray`.
"""
