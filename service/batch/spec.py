"""What a batch job computes (`JobSpec`): the task, the defaults a request may leave unset, and the
options that decide its rows. Its fingerprint is stored beside the output; a resume must match it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from service.fetch import DEFAULT_CONCURRENCY, DEFAULT_TIMEOUT_S

TASKS = ("caption", "ocr", "embed")
DEFAULT_PROMPTS = {
    "caption": "Describe this image in one short sentence.",
    "ocr": "Read all the text in this image. Reply with the text only, keeping its line breaks.",
}
DEFAULT_MAX_NEW_TOKENS = {"caption": 64, "ocr": 512}
EMBED_DTYPE = "float32"
# 3: rows in the OpenAI Batch output shape, in input order; sampling and model per request.
FORMAT = "kimi-vision-batch/3"


@dataclass(frozen=True)
class JobSpec:
    task: str
    prompt: str | None = None  # directory and path-list inputs: None -> the task's default prompt
    max_new_tokens: int | None = None  # for requests without max_tokens: None -> the task's default
    ignore_model: bool = False  # run requests whose `model` names another model
    allow_remote_images: bool = False  # fetch http(s) image URLs
    allowed_media_domains: tuple[str, ...] | None = None  # only from these hosts (None: any public one)
    # How remote images are fetched (not in the fingerprint: they change when a fetch fails, not what it gives).
    media_fetch_timeout_s: float = DEFAULT_TIMEOUT_S
    max_media_fetches: int = DEFAULT_CONCURRENCY

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.task == "embed" and (self.prompt is not None or self.max_new_tokens is not None):
            raise ValueError("--prompt and --max-new-tokens do not apply to --task embed")

    @property
    def effective_prompt(self) -> str | None:
        if self.task == "embed":
            return None
        return self.prompt if self.prompt is not None else DEFAULT_PROMPTS[self.task]

    @property
    def effective_max_new_tokens(self) -> int | None:
        return None if self.task == "embed" else (self.max_new_tokens or DEFAULT_MAX_NEW_TOKENS[self.task])

    def fingerprint(self, model_identity: str, errors: str | None = None) -> dict[str, Any]:
        """Stored beside the output; a resume must present the same dict. `errors`: the `--errors`
        file (as the output's directory sees it), whose rows belong to the job."""
        fp: dict[str, Any] = {"format": FORMAT, "task": self.task, "model": model_identity,
                              "ignore_model": self.ignore_model, "allow_remote_images": self.allow_remote_images,
                              "errors": errors}
        if self.allowed_media_domains:  # only when set: jobs from before the option resume as they were
            fp["allowed_media_domains"] = sorted(self.allowed_media_domains)
        if self.task == "embed":
            fp["embedding_dtype"] = EMBED_DTYPE
        else:
            # A request's own sampling, max_tokens and chat_template_kwargs win over these defaults.
            fp.update(prompt=self.effective_prompt, max_new_tokens=self.effective_max_new_tokens, thinking=False)
        return fp
