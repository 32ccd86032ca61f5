"""The job's Secret `<job>-token`: the token every pod of the job reads (`secretKeyRef`, never a
literal). A restarted master finds it and (by default) keeps its token, so that the pods it
adopts still speak for the job (see adoption.py)."""

from __future__ import annotations

import base64
import json
import time

from elastic_step.backends.kubernetes.errors import KubernetesBackendError
from elastic_step.backends.kubernetes.pods import TOKEN_KEY


def ensure_secret(
    call, core, name: str, namespace: str, *, labels: dict, owner_refs: list[dict], token: str, reuse: bool
) -> tuple[str, bool]:
    """Create the Secret `name` holding `token`; a restarted master finds it and (by default)
    keeps its token. (The token in use, whether it is the stored one.) `call`: the backend's API
    call; `core`: its CoreV1Api."""
    r = call("get", "secrets", core.read_namespaced_secret, name, namespace, ok=(404,), _preload_content=False)
    stored = None
    if r is not None:
        s = json.loads(r.data)
        stored = base64.b64decode((s.get("data") or {}).get(TOKEN_KEY, "")).decode()
        owners = [o.get("uid") for o in s["metadata"].get("ownerReferences") or []]
        keep = stored if reuse and stored else token
        if keep == stored and owners == [o["uid"] for o in owner_refs]:
            return stored, True
        # A new owner (a retried step) or a new token: re-create it, so the old owner's deletion
        # does not take it away (no 'patch' on secrets needed).
        call("delete", "secrets", core.delete_namespaced_secret, name, namespace, ok=(404,))
        token = keep
    body = {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {"name": name, "labels": labels, "ownerReferences": owner_refs},
        "stringData": {TOKEN_KEY: token},
    }
    for _ in range(20):  # a deleted Secret may take a moment to go
        if call("create", "secrets", core.create_namespaced_secret, namespace, body, ok=(409,)):
            break
        time.sleep(0.1)
    else:
        raise KubernetesBackendError(
            f"the Secret {name} in namespace {namespace} is still being deleted; retry the step"
        )
    return token, token == stored
