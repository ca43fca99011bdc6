"""Writes the KServe CRD schemas the manifests are validated against (tests/deploy/test_kserve.py).

    python deploy/kserve/schemas/extract.py KSERVE_CHECKOUT

Takes each CRD's served version's ``openAPIV3Schema`` from a kserve/kserve checkout's
``config/crd/full/`` and writes it as gzip-compressed JSON here (the CRDs are 0.2 and 2 MB of YAML).
The files here come from kserve/kserve at aaac4e294dae2c7b1aa1886447793f3aa1c30912 (2026-08-21),
Apache License 2.0.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import yaml

CRDS = {"servingruntimes": "servingruntime", "inferenceservices": "inferenceservice"}


def main() -> None:
    checkout = Path(sys.argv[1])
    for plural, name in CRDS.items():
        crd = yaml.safe_load((checkout / f"config/crd/full/serving.kserve.io_{plural}.yaml").read_text())
        (version,) = [v for v in crd["spec"]["versions"] if v.get("served") and v.get("storage")]
        text = json.dumps(version["schema"]["openAPIV3Schema"], separators=(",", ":"), sort_keys=True)
        out = Path(__file__).parent / f"{name}.{version['name']}.json.gz"
        out.write_bytes(gzip.compress(text.encode(), mtime=0))
        print(f"{out}: {crd['spec']['names']['kind']} {version['name']}, {len(text)} bytes of JSON")


if __name__ == "__main__":
    main()
