"""The run's picture: metrics.csv drawn into curves.png, with the metric names the trainer writes."""

from shardfc.train.runlog import plot_metrics


def test_plot_metrics_draws_the_scalars_the_trainer_writes(tmp_path):
    csv_path = tmp_path / "metrics.csv"
    lines = ["step,name,value,elapsed_s"]
    for step in range(0, 200, 10):
        lines += [
            f"{step},train/loss,{10 - step / 40},1.0",
            f"{step},train/lr,0.1,1.0",
            f"{step},train/images_per_s,500,1.0",
            f"{step},train/epoch,{step // 50},1.0",  # bookkeeping: no panel
        ]
    lines += [
        "100,val/synthetic/accuracy,0.8,2.0",
        "199,val/synthetic/accuracy,0.9,3.0",
        "199,val/lfw/tar@far=0.001,0.7,3.0",
        "199,val/lfw/achieved_far@far=0.001,0.001,3.0",  # bookkeeping: no panel
        "199,val/market/mAP,0.5,3.0",
        "200,train/lo",  # the torn last line of an interrupted run
    ]
    csv_path.write_text("\n".join(lines) + "\n")
    png = tmp_path / "curves.png"
    drawn = plot_metrics(csv_path, png)
    assert drawn[0] == "train/loss"
    assert set(drawn) == {
        "train/loss", "train/lr", "train/images_per_s",
        "val/synthetic/accuracy", "val/lfw/tar@far=0.001", "val/market/mAP",
    }
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_metrics_with_nothing_to_draw(tmp_path):
    csv_path = tmp_path / "metrics.csv"
    csv_path.write_text("step,name,value,elapsed_s\n")
    assert plot_metrics(csv_path, tmp_path / "curves.png") == []
    assert not (tmp_path / "curves.png").exists()
