"""The OpenAI-compatible HTTP face: the app (`app.py`: chat completions, EC producer mode, health,
models) and its uvicorn runner inside the server's event loop (`server.py`)."""
