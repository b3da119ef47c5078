"""Serve a local Qwen2.5-VL checkpoint over the OpenAI-compatible chat-completions API (constrained JSON
replies), for the harness's endpoint planner or any OpenAI client:

    python -m experiments.serve --model=<save_pretrained dir> [--host=127.0.0.1 --port=8000 --name=...]

Then: ``--config.planner=endpoint --config.endpoint.base_url=http://127.0.0.1:8000/v1`` for
``experiments.longhorizon``, with OPENAI_API_KEY set to any non-empty value.
"""

from __future__ import annotations

from absl import app, flags

flags.DEFINE_string("model", "", "A Hugging Face Qwen2.5-VL save_pretrained directory.")
flags.DEFINE_string("host", "127.0.0.1", "Address to listen on.")
flags.DEFINE_integer("port", 8000, "Port to listen on.")
flags.DEFINE_string("name", "", "The model id clients name (default: the directory's name).")
flags.DEFINE_integer("image_pixels", 28 * 28 * 4, "Pixels each image is resized to.")
flags.DEFINE_integer("max_tokens_cap", 1024, "The largest max_tokens a request may ask for.")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    import uvicorn

    from histeve_jax.harness.planners.local import LocalModel
    from histeve_jax.harness.server import make_app

    f = flags.FLAGS
    if not f.model:
        raise SystemExit("error: --model=<a Qwen2.5-VL save_pretrained directory> is required")
    try:
        model = LocalModel(f.model, image_pixels=f.image_pixels, name=f.name)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    print(f"serving {model.name} at http://{f.host}:{f.port}/v1", flush=True)
    app_ = make_app(model, max_tokens_cap=f.max_tokens_cap)
    uvicorn.run(app_, host=f.host, port=f.port, log_level="warning")


if __name__ == "__main__":
    app.run(main)
