"""The OpenAI chat-completions wire format, shared by the HTTP face and batch jobs: a request body
-> the engine's chat (`request.py`), the bytes of its `image_url` parts (`images.py`), and the
`chat.completion` / chunk / error objects built from the engine's results (`response.py`)."""
