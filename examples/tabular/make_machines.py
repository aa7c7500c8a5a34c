"""Writes machines.csv: a made-up machine-health table (600 rows, seed 0) for examples/tabular/mlp.json.

    python examples/tabular/make_machines.py            # rewrites examples/tabular/machines.csv

Five numeric readings per machine and its state (ok, worn, faulty). The states differ in a
non-linear way (a worn machine vibrates more at high speed, a faulty one runs hot and draws
current in bursts), so a linear model is not enough but a small MLP is. Not real data.
"""

import csv
from pathlib import Path

import numpy as np

STATES = ("ok", "worn", "faulty")


def machines(rows: int = 600, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(rows):
        state = STATES[i % 3]
        rpm = rng.uniform(800, 3000)
        age = rng.uniform(100, 20000) * (1.6 if state != "ok" else 1.0)
        vibration = 0.5 + rpm / 3000 * (2.2 if state == "worn" else 1.0) + rng.normal(0, 0.25)
        temperature = 40 + rpm / 150 + (12 if state == "faulty" else 0) + rng.normal(0, 4)
        current = 8 + rpm / 500 + (rng.exponential(3) if state == "faulty" else 0) + rng.normal(0, 0.6)
        out.append({"temperature_c": round(temperature, 2), "vibration_mm_s": round(vibration, 3),
                    "current_a": round(current, 2), "rpm": round(rpm), "age_hours": round(age), "state": state})
    return out


if __name__ == "__main__":
    path = Path(__file__).with_name("machines.csv")
    rows = machines()
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path} ({len(rows)} rows)")
