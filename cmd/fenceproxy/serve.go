package main

import (
	"context"
	"fmt"
	"io"
	"os/signal"
	"syscall"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/fenceproxy/fenceproxy/internal/config"
	"github.com/fenceproxy/fenceproxy/internal/service"
)

func serveMain(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	c := newCommand("serve", "serve [--config FILE]", stdout, stderr)
	path := c.configFlag("fenceproxy.yaml", "config file")
	if code, ok := c.parse(args); !ok {
		return code
	}
	// SIGHUP reloads; until the reload handler is installed it must not
	// end the process.
	signal.Ignore(syscall.SIGHUP)
	cfg, err := config.Load(*path)
	if err != nil {
		fmt.Fprintf(stderr, "fenceproxy: %v\n", err)
		return 1
	}
	log, err := newLogger(cfg.Log, stderr)
	if err != nil {
		fmt.Fprintf(stderr, "fenceproxy: %v\n", err)
		return 1
	}
	defer func() { _ = log.Sync() }()
	if err := service.RunConfig(ctx, cfg, *path, log, nil); err != nil {
		log.Error("fenceproxy stopped", zap.Error(err))
		return 1
	}
	return 0
}

func newLogger(lc config.Log, w io.Writer) (*zap.Logger, error) {
	level, err := zapcore.ParseLevel(lc.Level)
	if err != nil {
		return nil, fmt.Errorf("log.level: %w", err)
	}
	ec := zap.NewProductionEncoderConfig()
	ec.EncodeTime = zapcore.ISO8601TimeEncoder
	var enc zapcore.Encoder
	if lc.Format == "console" {
		ec.EncodeLevel = zapcore.CapitalLevelEncoder
		enc = zapcore.NewConsoleEncoder(ec)
	} else {
		enc = zapcore.NewJSONEncoder(ec)
	}
	core := zapcore.NewCore(enc, zapcore.Lock(zapcore.AddSync(w)), level)
	return zap.New(core), nil
}
