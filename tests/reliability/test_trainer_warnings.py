"""The balanced trainers say what the monitor cannot measure or adapt, and when the default topology's step is
smaller than a document (old: a balanced-looking figure from waiting time, a silent adapt, an unwarned idle rank)."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import TrainingArguments

from balancer.trainers.balance import MEASURED, blind_spots
from balancer.trainers.defaults import default_topology


def test_gradient_accumulation_one_on_several_processes_is_named():
    (line,) = blind_spots("shadow", 1, 2, None)
    assert "gradient_accumulation_steps=1" in line and "not logged" in line and "adapt" not in line
    (line,) = blind_spots("adapt", 1, 4, 3)
    assert "cannot adapt" in line and "gradient_accumulation_steps >= 2" in line
    assert "measured_imbalance" in MEASURED and "idle_fraction" in MEASURED and "predicted_imbalance" not in MEASURED


def test_adapt_on_one_window_says_so_once():
    (line,) = blind_spots("adapt", 4, 2, 1)
    assert "one window" in line and "window_docs" in line
    assert blind_spots("shadow", 4, 2, 1) == [] and blind_spots("adapt", 4, 2, 5) == []
    assert blind_spots("adapt", 1, 1, 5) == []  # one process: nothing waits


def test_default_topology_warns_when_a_document_outgrows_the_step(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=1, report_to=[])
    lengths = np.full(200, 300)
    lengths[57] = 9000  # mean ~ 343: a step of 1 x 1 x 1 documents of the mean length, far below 9000
    with pytest.warns(UserWarning, match=r"training document 57 \(9,000 tokens\).*gradient_accumulation_steps"):
        topo = default_topology(args, lengths)
    assert topo.tokens_per_step < 9000


def test_default_topology_is_quiet_when_every_document_fits_a_step(tmp_path, recwarn):
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, report_to=[])
    default_topology(args, np.full(100, 300))
    assert not [w for w in recwarn if "default topology" in str(w.message)]
