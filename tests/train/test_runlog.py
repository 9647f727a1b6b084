"""The run's picture: metrics.csv drawn into curves.png."""

from shardfc.train.runlog import plot_metrics


def test_plot_metrics_draws_every_scalar(tmp_path):
    csv_path = tmp_path / "metrics.csv"
    lines = ["step,name,value,elapsed_s"]
    for step in range(0, 200, 10):
        lines += [f"{step},train/loss,{10 - step / 40},1.0", f"{step},train/lr,0.1,1.0"]
    lines += ["100,eval/synthetic/accuracy,0.8,2.0", "199,eval/synthetic/accuracy,0.9,3.0", "200,train/lo"]
    csv_path.write_text("\n".join(lines) + "\n")
    png = tmp_path / "curves.png"
    assert plot_metrics(csv_path, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_metrics_with_nothing_to_draw(tmp_path):
    csv_path = tmp_path / "metrics.csv"
    csv_path.write_text("step,name,value,elapsed_s\n")
    assert not plot_metrics(csv_path, tmp_path / "curves.png")
    assert not (tmp_path / "curves.png").exists()
