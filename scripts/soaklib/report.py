"""The soak's plots."""


def plot(rep, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ss = rep["samples"]
    if not ss:
        return False
    fig, axes = plt.subplots(5, 1, figsize=(10, 12), sharex=True)
    x = [s["saves"] for s in ss]
    for ax, key, label in zip(axes, ("rss_mb", "fds", "threads", "state_mb", "log_mb"),
                              ("daemon RSS (MiB)", "open fds", "threads", "state dir (MiB)",
                               "logs (MiB)")):
        ax.plot(x, [s[key] for s in ss], ".", markersize=2)
        if key == "rss_mb":
            ax.plot(x, [s["rss_mb"] - s.get("held_mb", 0) for s in ss], ".", markersize=2,
                    label="less staging, retained tier, block cache")
            ax.legend(loc="upper left", fontsize=8)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    kills = [e for e in rep["events"] if e["what"] == "restart"]
    # Each restart, at the saves done then (the nearest sample).
    for e in kills:
        near = min(ss, key=lambda s: abs(s["t"] - e["t"]))
        for ax in axes:
            ax.axvline(near["saves"], color="red", alpha=0.15, linewidth=0.6)
    axes[-1].set_xlabel("saves done (red: a daemon SIGKILL and restart)")
    c = rep["counts"]
    fig.suptitle(f"ckptfs soak, {rep['mode']}, {rep.get('nodes', 1)} node(s), seed {rep['seed']}: {c['daemon_kills']} kills, "
                 f"{c['saves_train'] + c['saves_resave'] + c['saves_recreate']} saves, "
                 f"{len(rep['failures'])} failures")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True
