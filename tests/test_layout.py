"""The house rules, read off the code's own imports: data flows one way (bytes -> vision/ ->
textcore/ -> service/), the engine is below every face, the faces are peers under the serving
process, and the faces reach the model only through the engine."""

from __future__ import annotations

import ast
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# What only the engine may touch: the pool and its workers, the tower, the trunk and its decoding.
MODEL_PARTS = ("service.engine.pool", "service.engine.worker", "vision.encoder", "vision.tower", "vision.projector",
               "textcore.model", "textcore.generate")
# The faces that turn bytes into rows: every one must go through the engine.
FACES = ("service/rpc", "service/http", "service/openai", "service/batch", "service/cli/embed.py",
         "service/cli/serve.py", "service/cli/demo.py", "service/cli/batch.py")


def _modules(*places: str) -> list[Path]:
    out = []
    for place in places:
        path = REPO_ROOT / place
        out += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return [p for p in out if "_proto" not in p.parts]


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, at its top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def _offenders(places: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    return [f"{path.relative_to(REPO_ROOT)} imports {name}" for path in _modules(*places)
            for name in sorted(_imports(path)) if name.startswith(forbidden)]


def test_data_flows_one_way():
    assert _offenders(("vision",), ("textcore", "service")) == []
    assert _offenders(("textcore",), ("service",)) == []


def test_the_engine_is_below_every_face():
    assert _offenders(("service/engine",), ("service.rpc", "service.http", "service.openai", "service.batch",
                                            "service.cli", "service.checkpoints", "service.server",
                                            "service.admission")) == []


def test_the_two_server_faces_are_peers_under_the_serving_process():
    """`service.server` starts the gRPC and the HTTP face; neither imports the other or it."""
    assert _offenders(("service/rpc",), ("service.http", "service.server")) == []
    assert _offenders(("service/http", "service/openai"), ("service.rpc", "service.server")) == []
    # What the two faces share sits below both: admission, the error taxonomy, auth, metrics, logs.
    shared = ("service/admission.py", "service/errors.py", "service/auth.py", "service/metrics.py",
              "service/logs.py", "service/tracing.py")
    assert _offenders(shared, ("service.rpc", "service.http", "service.openai", "service.server")) == []


def test_faces_reach_the_model_only_through_the_engine():
    assert _offenders(FACES, MODEL_PARTS) == []


def test_the_epd_transports_sit_beside_the_faces():
    """`service.epd` takes encodings from the engine and delivers them; the engine never imports
    it (it returns encodings; the one directory it writes is its own store, `service.engine.store`),
    and it imports no face."""
    assert _offenders(("service/engine",), ("service.epd",)) == []
    assert _offenders(("service/epd",), ("service.rpc", "service.http", "service.openai", "service.batch",
                                         "service.cli", "service.server")) == []
    assert _offenders(FACES, ("service.engine.vllm", "service.http.sglang_wire")) == []


def test_the_grpc_face_needs_nothing_of_the_openai_or_http_faces():
    """The rules every face shares (JSON depth, the media fetcher, the image-part rule) are neutral
    modules; the gRPC face imports neither the OpenAI parser nor the HTTP face."""
    assert _offenders(("service/rpc",), ("service.openai", "service.http")) == []
    neutral = ("service/jsontext.py", "service/media.py", "service/fetch.py")
    assert _offenders(neutral, ("service.rpc", "service.http", "service.openai", "service.batch",
                                "service.server", "service.epd")) == []


def test_the_service_imports_have_no_cycles():
    """Between the service's modules, at module level (a function's own import is deferred)."""
    graph: dict[str, set[str]] = {}
    for path in _modules("service"):
        name = ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts).removesuffix(".__init__")
        tree = ast.parse(path.read_text(), str(path))
        targets = set()
        for node in tree.body:  # module level only; TYPE_CHECKING blocks are not imports at run time
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets.add(node.module)
            elif isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
        graph[name] = {t for t in targets if t.startswith("service")}
    # A package's __init__ importing its own submodules is the package, not a cycle.
    def edges(module: str) -> set[str]:
        return {t for t in graph.get(module, ()) if t in graph and not t.startswith(module + ".")}

    state: dict[str, int] = {}
    cycles: list[str] = []

    def visit(module: str, trail: list[str]) -> None:
        state[module] = 1
        for target in edges(module):
            if state.get(target) == 1:
                cycles.append(" -> ".join([*trail[trail.index(target):], target]) if target in trail else target)
            elif target not in state:
                visit(target, [*trail, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []
