package service

import (
	"context"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"github.com/fsnotify/fsnotify"

	"github.com/fenceproxy/fenceproxy/internal/config"
	"go.uber.org/zap"
)

// WatchReloads reloads the instance on SIGHUP and whenever the config file
// changes, until ctx is done. The file's directory is watched rather than
// the file, so editors and config managers that replace the file by rename
// (and Kubernetes ConfigMap symlink swaps) are seen too. Bursts of events
// are coalesced into one reload.
func (in *Instance) WatchReloads(ctx context.Context) {
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)

	var events <-chan fsnotify.Event
	var errs <-chan error
	if in.path != "" {
		w, err := fsnotify.NewWatcher()
		if err != nil {
			in.log.Warn("config file watch unavailable; SIGHUP still reloads", zap.Error(err))
		} else {
			defer w.Close()
			if err := w.Add(filepath.Dir(in.path)); err != nil {
				in.log.Warn("config file watch unavailable; SIGHUP still reloads", zap.Error(err))
			} else {
				events, errs = w.Events, w.Errors
			}
		}
	}
	target, _ := filepath.Abs(in.path)
	var debounce <-chan time.Time
	for {
		select {
		case <-ctx.Done():
			return
		case <-hup:
			in.log.Info("SIGHUP received; reloading config")
			_ = in.Reload()
		case ev := <-events:
			p, _ := filepath.Abs(ev.Name)
			if p == target || filepath.Base(ev.Name) == "..data" {
				debounce = time.After(200 * time.Millisecond)
			}
		case err := <-errs:
			in.log.Warn("config file watch error", zap.Error(err))
		case <-debounce:
			debounce = nil
			in.log.Info("config file changed; reloading")
			_ = in.Reload()
		}
	}
}

// RunConfig starts an instance from cfg (loaded from cfgPath), reloads it
// on SIGHUP and file changes, and drains it when ctx is done. ready, when
// non-nil, is called once it listens.
func RunConfig(ctx context.Context, cfg *config.Config, cfgPath string, log *zap.Logger, ready func(*Instance)) error {
	in, err := Start(cfg, cfgPath, log)
	if err != nil {
		return err
	}
	if ready != nil {
		ready(in)
	}
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go in.WatchReloads(wctx)
	select {
	case err := <-in.Wait():
		_ = in.stop(0) // no listener: nothing to wait for
		return err
	case <-ctx.Done():
	}
	return in.Shutdown()
}
