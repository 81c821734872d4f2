"""bench/predict.py: which rows carry the batch-norm fusion label."""
import tinysn as sn
from bench.predict import fuses_a_batch_norm


def test_only_nets_with_a_fusible_batch_norm_are_labelled_fused():
    """VGG16 has no batch norm, so planning it with fuse_bn_relu changes nothing and its
    rows carry no label; ResNet-50's batch norms feed ReLUs."""
    assert not fuses_a_batch_norm(sn.models.vgg16(batch=2))
    assert not fuses_a_batch_norm(sn.models.alexnet(batch=2))
    assert fuses_a_batch_norm(sn.models.resnet50(batch=2))


def test_today_plans_a_tracked_run_as_todays_planner_does():
    """--today plans a tracked ResNet-50 batch-32 run from before fuse_add_relu and
    fuse_bn_add (its run with the batch norms' ReLUs fused) with today's defaults: each
    add's ReLU fused into it and each block's last batch norm fused into its add (16 + 16
    layer steps fewer each way than as it ran), still with the run's measured conv times."""
    from pathlib import Path
    from bench.predict import train_rows
    path = (Path(__file__).parent.parent
            / "bench/results/train-resnet50-b32-fuse-bn-NVIDIA-H200.json")
    ran, today = train_rows(path), train_rows(path, today=True)
    assert [r["cuda_graph"] for r in ran] == [r["cuda_graph"] for r in today] == [False, True]
    for before, now in zip(ran, today):
        assert before["plan_steps"] - now["plan_steps"] == 2 * (16 + 16)
        assert now["today"] and not before["today"]
        assert now["measured_s"] == before["measured_s"]
        assert now["predicted_s"] < before["predicted_s"]
