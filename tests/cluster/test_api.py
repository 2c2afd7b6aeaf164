"""The library's front door (cluster/api.py): every name it exports, the active-learning config
built from them alone, and a model factory passed as a function from a user's script."""
from __future__ import annotations

import json
import runpy
import sys

from conclave.cluster import api

# A user's script: its own factory, given to the library as a function (not a "module:function"
# string), for the teachers and the student; Ray sends a function of __main__ by value.
SCRIPT = '''
import json, sys
from torch import nn
from conclave.cluster.api import (RunDirectory, StudentConfig, TeacherStudent, TeacherStudentConfig, TeacherStudentData,
                                  TeachersConfig, TrainConfig, train_ensemble)


def tiny_net(num_classes, input_shape):
    return nn.Sequential(nn.Flatten(), nn.Linear(int(input_shape[-1] * input_shape[-2]), num_classes))


config = TeacherStudentConfig(
    name="callable", data=TeacherStudentData(public_size=60),
    teachers=TeachersConfig(count=4, model=tiny_net, train=TrainConfig(epochs=2, batch_size=32, lr=0.05)),
    student=StudentConfig(queries=20, batch_size=10, checkpoints=(), model=tiny_net,
                          train=TrainConfig(epochs=2, batch_size=8, lr=0.05)))
with train_ensemble(config, progress=False) as ensemble:
    outcome = TeacherStudent(config).teach(ensemble, RunDirectory(sys.argv[1], "callable"))
print(json.dumps({"asked": outcome.metrics["queries_asked"], "model": outcome.metrics["teachers"]["model"]}))
'''


def test_every_exported_name_resolves_and_builds_an_active_learning_config():
    assert all(hasattr(api, name) for name in api.__all__)
    config = api.ActiveLearningConfig(
        data=api.ActiveLearningData(private_size=300, num_shards=1), dpsgd=api.ActiveLearningDPSGD(epochs=1),
        selection=api.SelectionConfig(strategies=("random",), sizes=(20,)), finetune=api.FinetuneConfig(epochs=1),
        annotator=api.AnnotatorConfig())
    assert config.private_size == 300 and config.selection.sizes == (20,)


def test_a_factory_given_as_a_function_trains_the_teachers_and_the_student(ray_session, tmp_path, monkeypatch,
                                                                          capsys):
    """The script run as ``python train.py`` runs it (its functions are ``__main__``'s), in this
    process, on the session's Ray: a process and a Ray of its own would add their start and
    nothing this checks (suite time)."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(script), str(tmp_path / "results")])
    runpy.run_path(str(script), run_name="__main__")
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result == {"asked": 20, "model": "__main__:tiny_net"}
    written = json.loads((tmp_path / "results" / "callable" / "metrics.json").read_text())
    assert written["teachers"]["model"] == "__main__:tiny_net"
