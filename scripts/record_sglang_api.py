"""Record the names of SGLang's HTTP API and launcher flags that tandem relies on, from source.

Reads an unpacked SGLang wheel with `ast` only: nothing of SGLang is imported or executed, so
this runs on a machine where SGLang cannot (no GPU, no sgl_kernel). It writes names, never code
or prose: struct field names, route paths and methods, dict keys, CLI flag spellings. The output
is tests/fixtures/sglang_api.json, which tests/test_sglang_compat.py checks tandem against.

    pip download --no-deps sglang==0.5.23 -d /tmp/sglang_wheel
    mkdir -p /tmp/sglang_src && unzip -q -o /tmp/sglang_wheel/sglang-*.whl -d /tmp/sglang_src
    python scripts/record_sglang_api.py /tmp/sglang_src -o tests/fixtures/sglang_api.json
"""

from __future__ import annotations

import argparse
import ast
import json
import re
from pathlib import Path

HTTP_SERVER = "sglang/srt/entrypoints/http_server.py"
IO_STRUCT = "sglang/srt/managers/io_struct.py"
SAMPLING = "sglang/srt/sampling/sampling_params.py"
SERVER_ARGS = "sglang/srt/server_args.py"
ARG_FIELDS = "sglang/srt/arg_groups/fields"
TOKENIZER_MANAGER = "sglang/srt/managers/tokenizer_manager.py"
WEIGHT_VERSIONS = "sglang/srt/utils/weight_versions.py"
SCHEDULE_BATCH = "sglang/srt/managers/schedule_batch.py"
AUTH = "sglang/srt/utils/auth.py"
API_TYPES = "sglang/api/v1/api_types.py"

IO_STRUCTS = [
    "GenerateReqInput", "UpdateWeightFromDiskReqInput", "UpdateWeightFromDiskReqOutput",
    "PauseGenerationReqInput", "ContinueGenerationReqInput", "AbortReq", "FlushCacheReqInput",
    "UpdateWeightVersionReqInput",
]  # fmt: skip
CONTRACT_STRUCTS = [
    "GenerateRequest", "SamplingParams", "GenerateResponse", "GenerateMetaInfo", "LogprobEntry",
    "WeightVersionSpan", "FinishStop", "FinishLength", "FinishAbort", "ErrorBody",
    "AbortRequest", "AbortResponse", "GetModelInfoResponse", "GetServerInfoResponse",
]  # fmt: skip
RESPONSE_HANDLERS = [
    "model_info", "update_weights_from_disk", "pause_generation", "continue_generation",
    "update_weight_version",
]  # fmt: skip
ROUTE_DECORATORS = {"get", "post", "put", "delete", "patch", "head", "api_route", "websocket"}


def parse(root: Path, rel: str) -> ast.Module:
    return ast.parse((root / rel).read_text(encoding="utf-8"), filename=rel)


def classes(tree: ast.AST) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}


def functions(tree: ast.AST) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef)
    return {n.name: n for n in ast.walk(tree) if isinstance(n, kinds)}


def const_str(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def own_fields(cls: ast.ClassDef) -> list[str]:
    """Annotated names in a class body (dataclass / msgspec fields), ClassVars excluded."""
    return [
        s.target.id for s in cls.body
        if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
        and "ClassVar" not in ast.unparse(s.annotation)
    ]  # fmt: skip


def struct_fields(table: dict[str, ast.ClassDef], name: str) -> list[str]:
    """Fields of `name` including those of bases defined in the same module, bases first."""
    cls, out = table[name], []
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id in table:
            out += [f for f in struct_fields(table, base.id) if f not in out]
    return out + [f for f in own_fields(cls) if f not in out]


def annotation_of(cls: ast.ClassDef, field: str) -> ast.AST:
    return next(s.annotation for s in cls.body if isinstance(s, ast.AnnAssign) and s.target.id == field)


def dict_keys(node: ast.AST) -> list[str]:
    return [k for k in map(const_str, node.keys) if k] if isinstance(node, ast.Dict) else []


def keys_written(tree: ast.AST, var: str) -> list[str]:
    """String keys put into dict `var`: `var = {...}`, `var["k"] = ...`, `var.update({...})`."""
    keys: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id == var:
                    keys += dict_keys(node.value)
                elif isinstance(target, ast.Subscript) and ast.unparse(target.value) in (var, f"out['{var}']"):
                    keys += [k for k in [const_str(target.slice)] if k]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if ast.unparse(node.func.value) == var and node.func.attr in ("update", "setdefault"):
                keys += dict_keys(node.args[0]) if node.func.attr == "update" else [const_str(node.args[0])]
    return list(dict.fromkeys(k for k in keys if k))


def sglang_version(root: Path) -> str:
    for node in ast.walk(parse(root, "sglang/_version.py")):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__version__" for t in node.targets):
            return node.value.value
    raise RuntimeError("no __version__ in sglang/_version.py")


def routes(tree: ast.Module) -> list[dict]:
    out = []
    for fn in functions(tree).values():
        auth = next((ast.unparse(d.args[0]).split(".")[-1] for d in fn.decorator_list
                     if isinstance(d, ast.Call) and ast.unparse(d.func) == "auth_level"), None)  # fmt: skip
        doc = ast.get_docstring(fn) or ""
        moved = re.search(r"deprecated\W+use '?(/[\w/]+)", doc, re.IGNORECASE)
        body, query = None, []
        for arg, default in zip(fn.args.args, [None] * (len(fn.args.args) - len(fn.args.defaults)) + fn.args.defaults):
            ann = ast.unparse(arg.annotation) if arg.annotation else ""
            if default is not None and ast.unparse(default).startswith("Query("):
                query.append(arg.arg)
            elif m := re.fullmatch(r"Annotated\[(\w+), Body\(\)\]|(\w+(?:ReqInput|Req|Input))", ann):
                body = m.group(1) or m.group(2)
        for dec in fn.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)
                    and ast.unparse(dec.func.value) == "app" and dec.func.attr in ROUTE_DECORATORS):  # fmt: skip
                continue
            path, env = const_str(dec.args[0]), None
            if path is None and isinstance(dec.args[0], ast.Call) and len(dec.args[0].args) == 2:
                env, path = map(const_str, dec.args[0].args)  # os.environ.get("VAR", "/default")
            if path is None:
                continue
            methods = [dec.func.attr.upper()]
            if dec.func.attr == "api_route":
                kw = next((k.value for k in dec.keywords if k.arg == "methods"), None)
                methods = [const_str(e) for e in kw.elts] if kw is not None else ["GET"]
            route = {"path": path, "methods": methods, "handler": fn.name}
            route |= {k: v for k, v in [("body", body), ("query", query), ("auth_level", auth)] if v}
            if moved:
                route["deprecated_for"] = moved.group(1)
            if env:
                route["path_env_override"] = env
            out.append(route)
    return sorted(out, key=lambda r: (r["path"], r["methods"]))


def is_bool(ann: ast.AST) -> bool:
    return ast.unparse(ann).replace(" ", "") in ("bool", "Optional[bool]", "bool|None")


def takes_value(action: str, kw: dict[str, ast.AST]) -> bool | None:
    """Whether a flag with a custom argparse action consumes a value; None if unknowable."""
    if re.search(r"BooleanOptional|StoreTrue|StoreFalse|store_true|store_false|store_const", action):
        return False
    nargs = kw.get("nargs") or next(
        (v for k, v in zip(getattr(kw.get("action_kwargs"), "keys", []), getattr(kw.get("action_kwargs"), "values", []))
         if const_str(k) == "nargs"), None)  # fmt: skip
    if nargs is not None:
        return ast.unparse(nargs) != "0"
    return None


def server_args(root: Path) -> dict:
    tree = parse(root, SERVER_ARGS)
    ns_names = next(
        [ast.unparse(e) for e in n.value.elts] for n in ast.walk(tree)
        if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "_INPUT_NAMESPACES"
    )  # fmt: skip
    ns_classes: dict[str, tuple[str, ast.ClassDef]] = {}
    for path in sorted((root / ARG_FIELDS).glob("*.py")):
        for name, cls in classes(ast.parse(path.read_text(encoding="utf-8"))).items():
            ns_classes.setdefault(name, (f"{ARG_FIELDS}/{path.name}", cls))
    missing = sorted(set(ns_names) - set(ns_classes))
    if missing:
        raise RuntimeError(f"namespace classes not found under {ARG_FIELDS}: {missing}")
    fields, flags, no_cli = [], {}, []
    sources = [ns_classes[n] for n in ns_names] + [(SERVER_ARGS, classes(tree)["ServerArgs"])]
    for _, cls in sources:
        for stmt in cls.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            name, ann = stmt.target.id, stmt.annotation
            fields.append(name)
            annotated = isinstance(ann, ast.Subscript) and ast.unparse(ann.value) in ("A", "Annotated")
            meta = ann.slice.elts if annotated else []
            inner = meta[0] if meta else ann
            arg = next((m for m in meta[1:] if not (isinstance(m, ast.Call) and ast.unparse(m.func) != "Arg")), None)
            kw = {k.arg: k.value for k in arg.keywords} if isinstance(arg, ast.Call) else {}
            if arg is None or ast.unparse(kw.get("no_cli", ast.Constant(False))) == "True":
                no_cli.append(name)
                continue
            names = [const_str(kw.get("cli_name")) or "--" + name.replace("_", "-")]
            names += [const_str(e) for e in getattr(kw.get("aliases"), "elts", [])]
            action = ast.unparse(kw["action"]) if "action" in kw else None
            if action and "BooleanOptional" in action:  # argparse adds --no-<flag> too
                names += ["--no-" + n[2:] for n in names]
            entry = {"field": name, "takes_value": takes_value(action, kw) if action else not is_bool(inner)}
            if isinstance(kw.get("choices"), ast.List):
                entry["choices"] = [e.value for e in kw["choices"].elts if isinstance(e, ast.Constant)]
            for flag in names:
                flags[flag] = dict(entry, alias_of=names[0]) if flag != names[0] else entry
    add_cli = functions(classes(tree)["ServerArgs"])["add_cli_args"]
    for call in ast.walk(add_cli):
        if isinstance(call, ast.Call) and ast.unparse(call.func) == "parser.add_argument":
            kw = {k.arg: k.value for k in call.keywords}
            action = ast.unparse(kw["action"]) if "action" in kw else None
            for flag in filter(None, map(const_str, call.args)):
                flags[flag] = {
                    "field": const_str(kw.get("dest")) or flag.lstrip("-").replace("-", "_"),
                    "takes_value": takes_value(action, kw) if action else True,
                    "deprecated": "Deprecated" in ast.unparse(kw.get("help", ast.Constant(""))),
                }  # fmt: skip
    return {
        "files": [SERVER_ARGS] + sorted({ns_classes[n][0] for n in ns_names}),
        "launcher_module": "sglang.launch_server",
        "fields": sorted(set(fields)),
        "fields_without_cli_flag": sorted(set(no_cli) - {f["field"] for f in flags.values()}),
        "cli_flags": dict(sorted(flags.items())),
    }


def record(root: Path) -> dict:
    io = classes(parse(root, IO_STRUCT))
    http = parse(root, HTTP_SERVER)
    handlers = functions(http)
    sampling = classes(parse(root, SAMPLING))["SamplingParams"]
    contract = classes(parse(root, API_TYPES))
    finish: dict[str, dict] = {}
    for cls in classes(parse(root, SCHEDULE_BATCH)).values():
        to_json = functions(cls).get("to_json")
        ret = next((n.value for n in ast.walk(to_json) if isinstance(n, ast.Return)), None) if to_json else None
        if isinstance(ret, ast.Dict):
            kind = const_str(ret.values[dict_keys(ret).index("type")])
            entry = finish.setdefault(kind, {"keys": dict_keys(ret), "classes": []})
            entry["classes"].append(cls.name)
    tokenizer_manager = parse(root, TOKENIZER_MANAGER)
    meta_keys = keys_written(tokenizer_manager, "meta_info") + keys_written(parse(root, WEIGHT_VERSIONS), "meta_info")
    mode = ast.unparse(annotation_of(io["PauseGenerationReqInput"], "mode").slice)
    return {
        "sglang_version": sglang_version(root),
        "recorded_by": "scripts/record_sglang_api.py (ast only; SGLang is never imported)",
        "routes": {"file": HTTP_SERVER, "routes": routes(http)},
        "structs": {
            **{name: {"file": IO_STRUCT, "fields": struct_fields(io, name)} for name in IO_STRUCTS},
            "SamplingParams": {"file": SAMPLING, "fields": own_fields(sampling)},
        },
        "pause_modes": {"file": IO_STRUCT, "values": [ast.literal_eval(e) for e in ast.parse(mode).body[0].value.elts]},
        "http_contract": {
            "file": API_TYPES,
            "structs": {
                name: {
                    "fields": own_fields(contract[name]),
                    "unknown_keys": "rejected" if "unknown keys rejected" in ast.get_docstring(contract[name]) else "ignored",
                }
                for name in CONTRACT_STRUCTS
            },
        },
        "generate_meta_info_keys": {
            "files": [TOKENIZER_MANAGER, WEIGHT_VERSIONS],
            "keys": sorted(set(meta_keys)),
        },
        "generate_output_keys": {"file": TOKENIZER_MANAGER, "keys": sorted(keys_written(tokenizer_manager, "out_dict"))},
        "finish_reasons": {"file": SCHEDULE_BATCH, "types": dict(sorted(finish.items()))},
        "response_keys": {
            "file": HTTP_SERVER,
            "handlers": {
                name: sorted({k for n in ast.walk(handlers[name]) for k in dict_keys(n)}
                             | set(keys_written(handlers[name], "result")))
                for name in RESPONSE_HANDLERS
            },
        },  # fmt: skip
        "unauthenticated_path_prefixes": {
            "file": AUTH,
            "prefixes": sorted({const_str(n.args[0]) for n in ast.walk(parse(root, AUTH))
                                if isinstance(n, ast.Call) and ast.unparse(n.func) == "path.startswith"}),
        },  # fmt: skip
        "server_args": server_args(root),
    }


def compact_json(value, indent: str = "") -> str:
    """JSON with every object or list that fits in 120 columns on one line (short, diffable)."""
    flat = json.dumps(value)
    if len(indent) + len(flat) <= 120 or not isinstance(value, (dict, list)) or not value:
        return flat
    inner = indent + " "
    if isinstance(value, list) and not any(isinstance(v, (dict, list)) for v in value):
        lines = [inner]  # a long list of names: pack them into lines of at most 120 columns
        for item in map(json.dumps, value):
            if len(lines[-1]) + len(item) + 2 > 120 and lines[-1].strip():
                lines.append(inner)
            lines[-1] += item + ", "
        return "[\n" + "\n".join(line.rstrip() for line in lines).rstrip(",") + "\n" + indent + "]"
    if isinstance(value, list):
        items = [inner + compact_json(v, inner) for v in value]
        return "[\n" + ",\n".join(items) + "\n" + indent + "]"
    items = [f"{inner}{json.dumps(k)}: {compact_json(v, inner)}" for k, v in value.items()]
    return "{\n" + ",\n".join(items) + "\n" + indent + "}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="directory holding the unpacked wheel's sglang/")
    parser.add_argument("-o", "--output", type=Path, default=Path("tests/fixtures/sglang_api.json"))
    args = parser.parse_args()
    data = record(args.source)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(compact_json(data) + "\n", encoding="utf-8")
    print(f"wrote {args.output}: SGLang {data['sglang_version']}, {len(data['routes']['routes'])} routes, "
          f"{len(data['server_args']['fields'])} ServerArgs fields")  # fmt: skip


if __name__ == "__main__":
    main()
