package config_test

import (
	"os"
	"reflect"
	"regexp"
	"sort"
	"strings"
	"testing"

	"gopkg.in/yaml.v3"

	"github.com/fenceproxy/fenceproxy/internal/config"
)

// The configuration is described in three places: the struct (with a doc
// comment per field), config.example.yaml, and the reference table in
// docs/operating.md, "Configuration", which is the one operators read.
// TestConfigReference keeps them listing the same keys, so that a key added
// to the struct fails here until it is documented and shown in the example.

const (
	referenceFile = "../../docs/operating.md"
	exampleFile   = "../../config.example.yaml"
)

func TestConfigReference(t *testing.T) {
	structKeys := keysOfType(reflect.TypeOf(config.Config{}), "")
	reference, defaults := referenceKeys(t)
	example, commented := exampleKeys(t)

	// The reference and the struct: the same keys, both ways.
	for _, k := range sorted(structKeys) {
		if !reference[k] {
			t.Errorf("%s: in the config struct but not in %s, \"Configuration\"", k, referenceFile)
		}
	}
	for _, k := range sorted(reference) {
		if !structKeys[k] {
			t.Errorf("%s: in %s, \"Configuration\", but not a key of the config struct", k, referenceFile)
		}
	}
	// The example file shows every key (a key shown commented out, as
	// "# listen_port: 6432", counts) and no key that is not documented.
	for _, k := range sorted(reference) {
		if _, ok := example[k]; !ok && !commented[lastPart(k)] {
			t.Errorf("%s: in %s but not shown in %s", k, referenceFile, exampleFile)
		}
	}
	for _, k := range sorted(example) {
		if _, ok := reference[k]; !ok {
			t.Errorf("%s: in %s but not in %s, \"Configuration\"", k, exampleFile, referenceFile)
		}
	}
	// Where the reference gives a default as one value, it is the value the
	// example file shows (which TestExampleFileLoads ties to Defaults).
	for _, k := range sorted(example) {
		if d, ok := defaults[k]; ok && example[k] != d {
			t.Errorf("%s: default %q in %s, %q in %s", k, d, referenceFile, example[k], exampleFile)
		}
	}
	if len(reference) < 10 {
		t.Fatalf("only %d keys read from %s: did the Configuration section's table move?", len(reference), referenceFile)
	}
}

// keysOfType lists the leaf keys of a configuration type as the reference
// spells them: nested mappings joined with ".", list items as "[]"
// (tables[].scope.users). The names are the fields' yaml tags, read as
// gopkg.in/yaml.v3 reads them.
func keysOfType(typ reflect.Type, prefix string) map[string]bool {
	keys := map[string]bool{}
	for i := 0; i < typ.NumField(); i++ {
		f := typ.Field(i)
		if !f.IsExported() {
			continue
		}
		tag := f.Tag.Get("yaml")
		if tag == "-" {
			continue
		}
		name, opts, _ := strings.Cut(tag, ",")
		if name == "" {
			name = strings.ToLower(f.Name) // yaml.v3's default
		}
		ft := f.Type
		for ft.Kind() == reflect.Pointer {
			ft = ft.Elem()
		}
		if strings.Contains(opts, "inline") && ft.Kind() == reflect.Struct {
			for k := range keysOfType(ft, prefix) {
				keys[k] = true
			}
			continue
		}
		key := prefix + name
		switch {
		case isMapping(ft):
			for k := range keysOfType(ft, key+".") {
				keys[k] = true
			}
		case ft.Kind() == reflect.Slice && isMapping(ft.Elem()):
			for k := range keysOfType(ft.Elem(), key+"[].") {
				keys[k] = true
			}
		default:
			keys[key] = true
		}
	}
	return keys
}

// isMapping reports whether a field's type is written as a YAML mapping of
// its own keys: a struct that does not read itself from a scalar.
func isMapping(t reflect.Type) bool {
	if t.Kind() != reflect.Struct {
		return false
	}
	u := reflect.TypeOf((*yaml.Unmarshaler)(nil)).Elem()
	return !t.Implements(u) && !reflect.PointerTo(t).Implements(u)
}

// referenceKeys reads the keys of the reference table, the rows under
// "## Configuration" whose first cell is one key in backquotes, and the
// defaults given there as one value in backquotes.
func referenceKeys(t *testing.T) (keys map[string]bool, defaults map[string]string) {
	t.Helper()
	b, err := os.ReadFile(referenceFile)
	if err != nil {
		t.Fatal(err)
	}
	_, section, ok := strings.Cut(string(b), "\n## Configuration\n")
	if !ok {
		t.Fatalf("%s has no \"## Configuration\" section", referenceFile)
	}
	if i := strings.Index(section, "\n## "); i >= 0 {
		section = section[:i]
	}
	row := regexp.MustCompile("^\\| `([a-z_\\[\\].]+)` \\| ([^|]*) \\|")
	value := regexp.MustCompile("^`([^`]*)`$")
	keys, defaults = map[string]bool{}, map[string]string{}
	for _, line := range strings.Split(section, "\n") {
		m := row.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		if keys[m[1]] {
			t.Errorf("%s: listed twice in %s", m[1], referenceFile)
		}
		keys[m[1]] = true
		if d := value.FindStringSubmatch(strings.TrimSpace(m[2])); d != nil {
			defaults[m[1]] = d[1]
		}
	}
	return keys, defaults
}

// exampleKeys reads the example file's keys, spelt as the reference spells
// them, with their scalar values, and the last parts of the keys it shows
// commented out ("# listen_port: 6432").
func exampleKeys(t *testing.T) (keys map[string]string, commented map[string]bool) {
	t.Helper()
	b, err := os.ReadFile(exampleFile)
	if err != nil {
		t.Fatal(err)
	}
	var doc yaml.Node
	if err := yaml.Unmarshal(b, &doc); err != nil {
		t.Fatalf("%s: %v", exampleFile, err)
	}
	keys = map[string]string{}
	if len(doc.Content) == 1 {
		walkExample(doc.Content[0], "", keys)
	}
	commented = map[string]bool{}
	re := regexp.MustCompile(`(?m)^\s*# ([a-z_]+): \S`)
	for _, m := range re.FindAllStringSubmatch(string(b), -1) {
		commented[m[1]] = true
	}
	return keys, commented
}

func walkExample(n *yaml.Node, prefix string, keys map[string]string) {
	switch n.Kind {
	case yaml.MappingNode:
		for i := 0; i+1 < len(n.Content); i += 2 {
			key, value := prefix+n.Content[i].Value, n.Content[i+1]
			switch {
			case value.Kind == yaml.MappingNode:
				walkExample(value, key+".", keys)
			case value.Kind == yaml.SequenceNode && len(value.Content) > 0 && value.Content[0].Kind == yaml.MappingNode:
				for _, item := range value.Content {
					walkExample(item, key+"[].", keys)
				}
			case value.Kind == yaml.ScalarNode:
				keys[key] = value.Value
			default:
				keys[key] = "" // a list of scalars
			}
		}
	}
}

func lastPart(key string) string {
	return key[strings.LastIndexAny(key, ".]")+1:]
}

func sorted[V any](m map[string]V) []string {
	s := make([]string, 0, len(m))
	for k := range m {
		s = append(s, k)
	}
	sort.Strings(s)
	return s
}
