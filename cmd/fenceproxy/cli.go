package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"runtime/debug"
	"strings"
)

// envPrefix starts the environment variable that sets each flag:
// FENCEPROXY_ and the flag's long name in upper case with "-" as "_"
// (--config: FENCEPROXY_CONFIG; lock --token-setting:
// FENCEPROXY_TOKEN_SETTING). A flag given on the command line wins.
const envPrefix = "FENCEPROXY_"

// command is one subcommand's flags.
type command struct {
	fs       *flag.FlagSet
	synopsis string
	stdout   io.Writer
}

// newCommand returns the flag set of subcommand name, whose usage line is
// "usage: fenceproxy SYNOPSIS".
func newCommand(name, synopsis string, stdout, stderr io.Writer) *command {
	c := &command{fs: flag.NewFlagSet(name, flag.ContinueOnError), synopsis: synopsis, stdout: stdout}
	c.fs.SetOutput(stderr)
	c.fs.Usage = func() {
		fmt.Fprintf(c.fs.Output(), "usage: fenceproxy %s\n\nflags (each also from $%s<NAME>):\n", c.synopsis, envPrefix)
		c.fs.PrintDefaults()
	}
	return c
}

// configFlag defines --config with its shorthand -c.
func (c *command) configFlag(def, usage string) *string {
	p := new(string)
	c.fs.StringVar(p, "config", def, usage)
	c.fs.StringVar(p, "c", def, "shorthand for --config")
	return p
}

// parse applies the environment, then args. It returns the exit status and
// false when the command should not run: 0 after --help (the usage goes to
// standard output), 2 after a usage error.
func (c *command) parse(args []string) (int, bool) {
	var envErr error
	c.fs.VisitAll(func(f *flag.Flag) {
		if len(f.Name) == 1 {
			return // shorthands share their long flag's variable
		}
		name := envPrefix + strings.ToUpper(strings.ReplaceAll(f.Name, "-", "_"))
		if v, ok := os.LookupEnv(name); ok && envErr == nil {
			if err := c.fs.Set(f.Name, v); err != nil {
				envErr = fmt.Errorf("$%s: %w", name, err)
			}
		}
	})
	if envErr != nil {
		fmt.Fprintf(c.fs.Output(), "fenceproxy %s: %v\n", c.fs.Name(), envErr)
		return exitUsage, false
	}
	if err := c.fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			out := c.fs.Output()
			c.fs.SetOutput(c.stdout)
			c.fs.Usage()
			c.fs.SetOutput(out)
			return 0, false
		}
		return exitUsage, false
	}
	return 0, true
}

// versionString reports the module version and VCS revision the binary
// was built from (go build records them), or the -ldflags version when set.
func versionString() string {
	if version != "dev" {
		return version
	}
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return version
	}
	v := bi.Main.Version
	var rev, modified string
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			if s.Value == "true" {
				modified = "+dirty"
			}
		}
	}
	if len(rev) > 12 {
		rev = rev[:12]
	}
	switch {
	case rev != "" && (v == "" || v == "(devel)"):
		return "devel-" + rev + modified
	case rev != "":
		return v + " (" + rev + modified + ")"
	case v != "":
		return v
	}
	return version
}
