"""The OpenAPI document, stating the real limits of the loaded model.

FastAPI generates the paths from the routes; this module adds what the raw-request inference
routes parse themselves: the JSON and .npy request bodies, the query options, every error
status with the one error body, and request schemas whose bounds are the live ones: D values
per row, ``max_batch_rows`` rows, k up to min(max_k, N), values within the model's
``input_abs_max``. The document is rebuilt when the model version changes.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from service.core.vocabulary import RULES
from service.engine.repository import MODEL_NAME
from service.wire import JSON, NPY

MODEL_NAME_PATTERN = MODEL_NAME.pattern

ERROR_DESCRIPTIONS = {
    400: "empty batch",
    401: "missing or wrong API key (when a key is configured)",
    406: "the Accept header asks for a type this route cannot return",
    409: "the artifact could not be loaded; the previous model keeps serving",
    413: "too many instances, body too large, or the answer would be too large",
    415: "unsupported Content-Type",
    422: "invalid input: wrong dimensionality, NaN/Inf, out-of-range or non-numeric values, "
    "ragged rows, unknown fields or query parameters, bad k or rule",
    429: "overloaded: too many requests in flight",
    503: "no model loaded yet, shutting down, or (an inference answer) the worker's budget of "
    "answers not yet taken by their clients is spent (answer_budget_spent)",
    404: "unknown model or version (a named route), or an unnamed route of a server that "
    "serves a model repository",
}
INFERENCE_ERRORS = (400, 401, 406, 413, 415, 422, 429, 503)
NAMED_ERRORS = (400, 401, 404, 406, 413, 415, 422, 429, 503)  # 404: no model of that name
V2_INFER_ERRORS = (400, 401, 404, 413, 415, 422, 429, 503)  # no Accept negotiation
NPY_ANSWERS = {  # the 200 answer with Accept: application/x-npy (see service.http.routes.inference)
    "embed": "float32 array (n, d)",
    "classify": "structured array (n,): label (int64, or a string when a class is not an "
    "integer), probabilities (C,) float64 in GET /v1/model's class order, nearest_distance "
    "float64, outlier bool (absent when the model has no outlier calibration); with neighbours "
    "also neighbor_ids (k,) int64, neighbor_labels (k,), neighbor_distances (k,) float64",
    "neighbors": "structured array (n,): ids (k,) int64, labels (k,), distances (k,) float64",
}
ROUTE_ERRORS = {
    "/v1/classify": INFERENCE_ERRORS,
    "/v1/embed": INFERENCE_ERRORS,
    "/v1/neighbors": INFERENCE_ERRORS,
    "/v1/models/{model_name}/classify": NAMED_ERRORS,
    "/v1/models/{model_name}/embed": NAMED_ERRORS,
    "/v1/models/{model_name}/neighbors": NAMED_ERRORS,
    "/v1/model": (401, 503),
    "/v1/models": (401,),
    "/v1/models/{model_name}": (401, 404, 503),
    "/v1/admin/reload": (401, 409),
    "/readyz": (503,),
    "/metrics": (401,),
    # the Open Inference Protocol (service.oip.rest); its error body is V2ErrorBody
    "/v2": (401,),
    "/v2/health/ready": (503,),
    "/v2/models/{model_name}": (401, 404, 503),
    "/v2/models/{model_name}/versions/{model_version}": (401, 404, 503),
    "/v2/models/{model_name}/ready": (401, 404, 503),
    "/v2/models/{model_name}/versions/{model_version}/ready": (401, 404, 503),
    "/v2/models/{model_name}/infer": V2_INFER_ERRORS,
    "/v2/models/{model_name}/versions/{model_version}/infer": V2_INFER_ERRORS,
    # the repository extension (service.oip.repository), behind the admin key; documented
    # when the server serves a repository
    "/v2/repository/index": (401, 413, 422),
    "/v2/repository/models/{model_name}/load": (401, 404, 409, 413, 422),
    "/v2/repository/models/{model_name}/unload": (401, 404, 409, 413, 422),
}
# with a repository, the unnamed routes answer 404 (name the model)
REPOSITORY_ERRORS = {path: (404,) for path in ("/v1/classify", "/v1/embed", "/v1/neighbors")}
REPOSITORY_ERRORS |= {"/v1/model": (404,), "/v1/admin/reload": (404,)}
V2_HEADER_LENGTH = {
    "name": "Inference-Header-Content-Length",
    "in": "header",
    "required": False,
    "description": "with binary tensor data: the byte length of the JSON request at the start "
    "of the body (1 to 18 ASCII digits, at most the body's length)",
    "schema": {"type": "integer", "minimum": 1, "maximum": 10**18 - 1},
}
V2_ERROR_BODY = {
    "type": "object",
    "required": ["error"],
    "additionalProperties": False,
    "properties": {"error": {"type": "string", "description": "what was wrong"}},
}
V2_INFER_BODY = {
    "required": True,
    "description": "The Open Inference Protocol's inference request (JSON), or with the "
    "binary tensor data extension the JSON request (its length in the "
    "Inference-Header-Content-Length header) followed by the inputs' raw bytes",
    "content": {
        JSON: {
            "schema": {
                "type": "object",
                "required": ["inputs"],
                "properties": {
                    "id": {"type": "string"},
                    "parameters": {"type": "object"},
                    "inputs": {"type": "array", "items": {"type": "object"}},
                    "outputs": {"type": "array", "items": {"type": "object"}},
                },
            }
        },
        "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
    },
}
ERROR_BODY = {
    "type": "object",
    "required": ["error", "error_type"],
    "properties": {
        "error": {"type": "string", "description": "what was wrong and what was expected"},
        "error_type": {"type": "string"},
    },
}


OUTLIER_QUANTILE = {"type": "number", "minimum": 0.5, "maximum": 0.999}
OUTLIER_QUANTILE_OR_NULL = {
    "anyOf": [OUTLIER_QUANTILE, {"type": "null"}],
    "description": "flag a prediction as an outlier when its nearest reference is farther "
    "than this quantile of held-out points' nearest distances (default: the setting "
    "outlier_quantile); also sets where the soft_prior rule's prior takes over",
}


def request_schemas(limits: dict[str, Any]) -> dict[str, dict]:
    """JSON schemas of the three request bodies under ``limits`` (see ``live_limits``)."""
    value: dict[str, Any] = {"type": "number"}
    row: dict[str, Any] = {"type": "array", "items": value, "minItems": 1}
    if limits.get("n_features"):
        value.update(minimum=-limits["input_abs_max"], maximum=limits["input_abs_max"])
        row.update(minItems=limits["n_features"], maxItems=limits["n_features"])
    instances = {
        "type": "array",
        "items": row,
        "minItems": 1,
        "maxItems": limits["max_batch_rows"],
        "description": f"1 to {limits['max_batch_rows']} rows of "
        f"{limits.get('n_features') or 'D'} finite numbers each",
    }
    index: dict[str, Any] = {"type": "integer", "minimum": 0}
    if limits.get("n_features"):
        index["maximum"] = limits["n_features"] - 1
    sparse_instances = {
        "type": "array",
        "items": {
            "type": "object",
            "additionalProperties": False,
            "required": ["indices", "values"],
            "properties": {
                "indices": {"type": "array", "items": index, "uniqueItems": True},
                "values": {"type": "array", "items": value},
            },
        },
        "minItems": 1,
        "maxItems": limits["max_batch_rows"],
        "description": f"1 to {limits['max_batch_rows']} rows by their non-zeros: column "
        f"indices in [0, {limits.get('n_features') or 'D'}) (any order, none twice) and as "
        "many values; the columns not named are 0. The embedding costs the non-zeros times d "
        "(for models of sparse inputs, where a dense row is D numbers)",
    }
    k = {"type": "integer", "minimum": 1, "maximum": limits["max_k"]}
    k_or_null = {
        "anyOf": [k, {"type": "null"}],
        "description": "neighbours (default: the model's); an integer literal (5.0 is refused)",
    }

    def body(**extra) -> dict:
        return {
            "type": "object",
            "additionalProperties": False,
            "oneOf": [{"required": ["instances"]}, {"required": ["sparse_instances"]}],
            "properties": {
                "instances": instances,
                "sparse_instances": sparse_instances,
                **extra,
            },
        }

    return {
        "EmbedRequest": body(),
        "NeighborsRequest": body(k=k_or_null),
        "ClassifyRequest": body(
            k=k_or_null,
            rule={
                "anyOf": [{"enum": list(RULES)}, {"type": "null"}],
                "description": "decision rule (default: the model's)",
            },
            return_neighbors={"type": "boolean", "description": "include the k neighbours"},
            outlier_quantile=OUTLIER_QUANTILE_OR_NULL,
        ),
    }


def query_parameters(names: list[str], limits: dict[str, Any]) -> list[dict]:
    schemas = {
        "k": {"type": "integer", "minimum": 1, "maximum": limits["max_k"]},
        "rule": {"type": "string", "enum": list(RULES)},
        "return_neighbors": {"type": "boolean"},
        "outlier_quantile": OUTLIER_QUANTILE,
    }
    descriptions = {
        "k": "neighbours (for .npy bodies; a JSON body's k wins)",
        "rule": "decision rule (for .npy bodies; a JSON body's rule wins)",
        "return_neighbors": "include the k neighbours (for .npy bodies)",
        "outlier_quantile": "outlier threshold as a quantile of held-out nearest distances "
        "(for .npy bodies; a JSON body's wins)",
    }
    return [
        {
            "name": name,
            "in": "query",
            "required": False,
            "schema": schemas[name],
            "description": descriptions[name],
        }
        for name in names
    ]


def build_openapi(app: FastAPI, limits: dict[str, Any], secured: bool) -> dict:
    spec = get_openapi(
        title=app.title,
        version=app.version,
        description=app.description,
        routes=app.routes,
    )
    components = spec.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    schemas.update(request_schemas(limits))
    schemas["ErrorBody"] = ERROR_BODY
    schemas["V2ErrorBody"] = V2_ERROR_BODY
    if secured:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    repository = bool(limits.get("repository"))
    if not repository:  # one model: the repository's load and unload only refuse
        for path in [p for p in spec["paths"] if p.startswith("/v2/repository/")]:
            del spec["paths"][path]
    for path, operations in spec["paths"].items():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            for status in ("422",):  # FastAPI's own validation answer: not ours
                if "HTTPValidationError" in str(responses.get(status, "")):
                    del responses[status]
            body_schema = operation.pop("x-ncaknn-body", None)
            query = operation.pop("x-ncaknn-query", None)
            npy_out = operation.pop("x-ncaknn-npy-out", False)
            if body_schema is not None:
                operation["requestBody"] = {
                    "required": True,
                    "content": {
                        JSON: {"schema": {"$ref": f"#/components/schemas/{body_schema}"}},
                        NPY: {
                            "schema": {"type": "string", "format": "binary"},
                            "description": "a 2-D .npy array (n, D) of integers or floats; "
                            "options go in the query string",
                        },
                    },
                }
                operation["parameters"] = query_parameters(query or [], limits)
                if "{model_name}" in path:
                    operation["parameters"].insert(0, model_name_parameter(limits))
            if npy_out:
                responses["200"]["content"][NPY] = {
                    "schema": {"type": "string", "format": "binary"},
                    "description": NPY_ANSWERS[npy_out],
                }
            if path == "/metrics":
                responses["200"] = {
                    "description": "Prometheus text exposition format",
                    "content": {"text/plain": {"schema": {"type": "string"}}},
                }
            v2 = path == "/v2" or path.startswith("/v2/")
            error_ref = "#/components/schemas/" + ("V2ErrorBody" if v2 else "ErrorBody")
            extra = REPOSITORY_ERRORS.get(path, ()) if repository else ()
            for status in sorted({*ROUTE_ERRORS.get(path, ()), *extra}):
                responses[str(status)] = {
                    "description": ERROR_DESCRIPTIONS[status],
                    "content": {JSON: {"schema": {"$ref": error_ref}}},
                }
            if v2:
                _describe_v2(path, operation, limits)
            if secured and path.startswith("/v1/"):
                operation["security"] = [{"bearer": []}]
    return spec


REPOSITORY_INDEX = {
    "type": "array",
    "items": {
        "type": "object",
        "required": ["name", "version", "state", "reason"],
        "properties": {
            "name": {"type": "string"},
            "version": {"type": "string"},
            "state": {"type": "string", "enum": ["READY", "LOADING", "UNAVAILABLE"]},
            "reason": {"type": "string"},
        },
    },
}


def _optional_body(properties: dict) -> dict:
    return {
        "required": False,
        "content": {
            JSON: {
                "schema": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": properties,
                }
            }
        },
    }


REPOSITORY_BODIES = {  # (an empty body takes the defaults)
    "index": _optional_body({"ready": {"type": "boolean", "description": "ready models only"}}),
    "load": _optional_body({"parameters": {"type": "object", "maxProperties": 0}}),
    "unload": _optional_body(
        {
            "parameters": {
                "type": "object",
                "additionalProperties": False,
                "properties": {"unload_dependents": {"type": "boolean"}},
            }
        }
    ),
}


def model_name_parameter(limits: dict[str, Any], any_folder: bool = False) -> dict:
    """A named route's model: one of the served names (any other answers 404); with a
    repository, one of the models serving now, or (``any_folder``: the load and unload
    calls, and while none serves) any name a model folder can have."""
    if not limits.get("repository"):
        schema = {"type": "string", "enum": [limits.get("v2_model_name")]}
    elif limits.get("model_names") and not any_folder:
        schema = {"type": "string", "enum": limits["model_names"]}
    else:
        schema = {"type": "string", "pattern": MODEL_NAME_PATTERN}
    return {
        "name": "model_name",
        "in": "path",
        "required": True,
        "schema": schema,
        "description": "the model's name (v2_model_name, or a repository's folder name)",
    }


def _describe_v2(path: str, operation: dict, limits: dict[str, Any]) -> None:
    """The protocol's routes: path parameters limited to the served name and version (any
    other answers 404), the infer body, and the 200 answers as the protocol's JSON."""
    for parameter in operation.get("parameters", []):
        if parameter.get("in") != "path":
            continue
        if parameter.get("name") == "model_name":
            any_folder = path.startswith("/v2/repository/")
            parameter["schema"] = model_name_parameter(limits, any_folder)["schema"]
        elif parameter.get("name") == "model_version" and limits.get("version"):
            parameter["schema"] = {"type": "string", "enum": [limits["version"]]}
    if path.endswith("/infer"):
        operation["requestBody"] = V2_INFER_BODY
        operation.setdefault("parameters", []).append(V2_HEADER_LENGTH)
        operation["responses"]["200"] = {
            "description": "the inference response (JSON), or the JSON header followed by "
            "binary outputs (application/octet-stream, with Inference-Header-Content-Length)",
            "content": {
                JSON: {"schema": {"type": "object"}},
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
            },
        }
    elif path.startswith("/v2/repository/"):
        operation["requestBody"] = REPOSITORY_BODIES[path.rsplit("/", 1)[1]]
        index = path == "/v2/repository/index"
        operation["responses"]["200"] = {
            "description": "every model: name, version, state, reason" if index else "done",
            "content": {JSON: {"schema": REPOSITORY_INDEX if index else {"type": "object"}}},
        }
    else:
        operation["responses"]["200"] = {
            "description": "the protocol's JSON answer",
            "content": {JSON: {"schema": {"type": "object"}}},
        }
