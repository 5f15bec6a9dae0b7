package catalog_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/catalog"
)

// indirectWant is one expected IndirectPath: every field but Via exactly,
// Via by a part of it.
type indirectWant struct {
	schema, name, kind, target string
	ops                        string // space-separated
	via                        string // must occur in Via
}

// indirectProof shows that a path is real: running write directly on
// PostgreSQL changes what check (a query on the protected table) returns.
// Each proof runs in a transaction that is rolled back.
type indirectProof struct {
	write, check string
}

// TestIndirectPaths: each case creates objects in a database of its own,
// lists the indirect paths to its protected tables, and for the main path
// kinds writes through them on the server to show that they do write the
// protected table.
func TestIndirectPaths(t *testing.T) {
	for _, tc := range []struct {
		name   string
		setup  string
		tables []catalog.Rel
		want   []indirectWant
		proofs []indirectProof
	}{
		{
			name: "views",
			setup: `
				CREATE TABLE config (id int PRIMARY KEY, x int);
				CREATE TABLE other (id int PRIMARY KEY, x int);
				INSERT INTO config VALUES (1, 1); INSERT INTO other VALUES (1, 1);
				CREATE VIEW v1 AS SELECT id, x FROM config WHERE x > 0;
				CREATE VIEW v2 AS SELECT * FROM v1;
				CREATE VIEW barrier WITH (security_barrier) AS SELECT * FROM config;
				CREATE VIEW computed AS SELECT id + 1 AS next FROM config;
				-- Not reported: not updatable, over an unprotected table, or
				-- reading config without writing it.
				CREATE VIEW distinct_x AS SELECT DISTINCT x FROM config;
				CREATE VIEW joined AS SELECT c.id, o.x FROM config c JOIN other o USING (id);
				CREATE VIEW over_other AS SELECT * FROM other;
				CREATE VIEW other_filtered AS SELECT * FROM other WHERE id IN (SELECT id FROM config);
				CREATE MATERIALIZED VIEW mat AS SELECT * FROM config;`,
			tables: []catalog.Rel{{Schema: "public", Name: "config"}},
			want: []indirectWant{
				{"public", "barrier", catalog.PathView, "public.config", "INSERT UPDATE DELETE", "auto-updatable view public.barrier writes public.config"},
				// No updatable column: only DELETE works.
				{"public", "computed", catalog.PathView, "public.config", "DELETE", "auto-updatable view public.computed writes public.config"},
				{"public", "v1", catalog.PathView, "public.config", "INSERT UPDATE DELETE", "auto-updatable view public.v1 writes public.config"},
				{"public", "v2", catalog.PathView, "public.config", "INSERT UPDATE DELETE",
					"auto-updatable view public.v2 writes public.v1; auto-updatable view public.v1 writes public.config"},
			},
			proofs: []indirectProof{
				{"UPDATE v2 SET x = 5", "SELECT x FROM config"},
				{"INSERT INTO v2 VALUES (2, 2)", "SELECT count(*) FROM config"},
				{"DELETE FROM computed", "SELECT count(*) FROM config"},
			},
		},
		{
			name: "INSTEAD OF trigger",
			setup: `
				CREATE TABLE config (id int PRIMARY KEY, x int);
				CREATE TABLE other (id int PRIMARY KEY, label text);
				CREATE VIEW labelled AS SELECT c.id, c.x, o.label FROM config c JOIN other o USING (id);
				CREATE FUNCTION labelled_insert() RETURNS trigger LANGUAGE plpgsql AS $$
				BEGIN
					INSERT INTO config VALUES (NEW.id, NEW.x);
					INSERT INTO other VALUES (NEW.id, NEW.label);
					RETURN NEW;
				END $$;
				CREATE TRIGGER labelled_insert INSTEAD OF INSERT ON labelled
					FOR EACH ROW EXECUTE FUNCTION labelled_insert();`,
			tables: []catalog.Rel{{Schema: "public", Name: "config"}},
			want: []indirectWant{
				{"public", "labelled", catalog.PathView, "public.config", "INSERT",
					"view public.labelled reads public.config and has INSTEAD OF trigger labelled_insert (INSERT, function public.labelled_insert), which runs instead of the write and can write anything"},
			},
			proofs: []indirectProof{
				{"INSERT INTO labelled VALUES (1, 1, 'one')", "SELECT count(*) FROM config"},
			},
		},
		{
			name: "rules",
			setup: `
				CREATE TABLE config (id int PRIMARY KEY, x int);
				CREATE TABLE requests (id int, x int);
				CREATE TABLE purge (id int);
				CREATE TABLE log (id int, x int);
				CREATE TABLE reader (id int);
				CREATE RULE apply AS ON INSERT TO requests DO ALSO INSERT INTO config VALUES (NEW.id, NEW.x);
				-- The write hides in a data-modifying WITH of a SELECT action.
				CREATE RULE purge_config AS ON INSERT TO purge
					DO INSTEAD WITH d AS (DELETE FROM config RETURNING id) SELECT count(*) FROM d;
				-- Reads config, writes log only: not reported.
				CREATE RULE copy AS ON INSERT TO reader DO ALSO INSERT INTO log SELECT * FROM config;
				-- A rule on a view that is not updatable by itself.
				CREATE VIEW config_sum AS SELECT sum(x) AS total FROM config;
				CREATE RULE reset AS ON UPDATE TO config_sum DO INSTEAD UPDATE config SET x = 0;
				-- A disabled rule does not fire.
				CREATE TABLE quiet (id int);
				CREATE RULE quiet_rule AS ON DELETE TO quiet DO ALSO DELETE FROM config;
				ALTER TABLE quiet DISABLE RULE quiet_rule;
				INSERT INTO config VALUES (1, 1);`,
			tables: []catalog.Rel{{Schema: "public", Name: "config"}},
			want: []indirectWant{
				{"public", "config_sum", catalog.PathRule, "public.config", "UPDATE", "rule reset on public.config_sum (ON UPDATE DO INSTEAD) runs UPDATE on public.config"},
				{"public", "purge", catalog.PathRule, "public.config", "INSERT", "rule purge_config on public.purge (ON INSERT DO INSTEAD) runs DELETE on public.config"},
				{"public", "requests", catalog.PathRule, "public.config", "INSERT", "rule apply on public.requests (ON INSERT DO ALSO) runs INSERT on public.config"},
			},
			proofs: []indirectProof{
				{"INSERT INTO requests VALUES (2, 2)", "SELECT count(*) FROM config"},
				{"INSERT INTO purge VALUES (1)", "SELECT count(*) FROM config"},
				{"UPDATE config_sum SET total = 1", "SELECT x FROM config"},
			},
		},
		{
			name: "rules on protected tables",
			setup: `
				CREATE TABLE acct (id int PRIMARY KEY, n int);
				CREATE TABLE ledger (id int PRIMARY KEY, n int);
				CREATE TABLE audit (id int, n int);
				INSERT INTO acct VALUES (1, 1); INSERT INTO ledger VALUES (1, 1);
				-- Another protected table, and the table itself (ON INSERT
				-- writing it is no recursion).
				CREATE RULE mirror AS ON UPDATE TO acct DO ALSO UPDATE ledger SET n = NEW.n WHERE id = NEW.id;
				CREATE RULE bump AS ON INSERT TO acct DO ALSO UPDATE acct SET n = n + 1 WHERE id = 1;
				-- Writes an unprotected table only: not reported.
				CREATE RULE note AS ON DELETE TO ledger DO ALSO INSERT INTO audit VALUES (OLD.id, OLD.n);`,
			tables: []catalog.Rel{{Schema: "public", Name: "acct"}, {Schema: "public", Name: "ledger"}},
			want: []indirectWant{
				{"public", "acct", catalog.PathRule, "public.acct", "INSERT", "rule bump on public.acct (ON INSERT DO ALSO) runs UPDATE on public.acct"},
				// The rule's UPDATE fires the other rule.
				{"public", "acct", catalog.PathRule, "public.ledger", "INSERT", "rule bump on public.acct (ON INSERT DO ALSO) runs UPDATE on public.acct; rule mirror on public.acct"},
				{"public", "acct", catalog.PathRule, "public.ledger", "UPDATE", "rule mirror on public.acct (ON UPDATE DO ALSO) runs UPDATE on public.ledger"},
			},
			proofs: []indirectProof{
				{"UPDATE acct SET n = 7 WHERE id = 1", "SELECT n FROM ledger"},
				{"INSERT INTO acct VALUES (2, 2)", "SELECT n FROM acct WHERE id = 1"},
				{"INSERT INTO acct VALUES (3, 3)", "SELECT n FROM ledger"},
			},
		},
		{
			name: "foreign keys between protected tables",
			setup: `
				CREATE TABLE orders (id int PRIMARY KEY);
				CREATE TABLE items (id int PRIMARY KEY, order_id int REFERENCES orders ON DELETE CASCADE);
				-- No action: nothing written, only TRUNCATE ... CASCADE.
				CREATE TABLE notes (id int PRIMARY KEY, order_id int REFERENCES orders);
				INSERT INTO orders VALUES (1); INSERT INTO items VALUES (1, 1);`,
			tables: []catalog.Rel{{Schema: "public", Name: "orders"}, {Schema: "public", Name: "items"}, {Schema: "public", Name: "notes"}},
			want: []indirectWant{
				{"public", "orders", catalog.PathForeignKey, "public.items", "DELETE MERGE", "ON DELETE CASCADE of foreign key items_order_id_fkey of public.items, which references public.orders"},
				{"public", "orders", catalog.PathTruncate, "public.items", "TRUNCATE", "TRUNCATE ... CASCADE truncates public.items"},
				{"public", "orders", catalog.PathTruncate, "public.notes", "TRUNCATE", "TRUNCATE ... CASCADE truncates public.notes"},
			},
			proofs: []indirectProof{
				{"DELETE FROM orders", "SELECT count(*) FROM items"},
			},
		},
		{
			// The write of a protected parent reaches its partitions' and
			// children's rows, whose own foreign keys' actions run
			// statements the parent's fence does not reach.
			name: "foreign keys of a protected table's descendants",
			setup: `
				CREATE TABLE orders (id int, region int, PRIMARY KEY (id, region)) PARTITION BY LIST (region);
				CREATE TABLE orders_1 PARTITION OF orders FOR VALUES IN (1);
				CREATE TABLE orders_2 PARTITION OF orders FOR VALUES IN (2);
				ALTER TABLE orders_1 ADD UNIQUE (id);
				CREATE TABLE items (id int PRIMARY KEY, order_id int REFERENCES orders_1 (id) ON DELETE CASCADE);
				CREATE TABLE docs (id int PRIMARY KEY);
				CREATE TABLE docs_old (PRIMARY KEY (id)) INHERITS (docs);
				CREATE TABLE pages (id int PRIMARY KEY, doc_id int REFERENCES docs_old ON UPDATE CASCADE);
				INSERT INTO orders VALUES (1, 1); INSERT INTO items VALUES (1, 1);
				INSERT INTO docs_old VALUES (1); INSERT INTO pages VALUES (1, 1);`,
			tables: []catalog.Rel{{Schema: "public", Name: "orders"}, {Schema: "public", Name: "items"}, {Schema: "public", Name: "docs"}, {Schema: "public", Name: "pages"}},
			want: []indirectWant{
				{"public", "docs", catalog.PathForeignKey, "public.pages", "UPDATE MERGE",
					"public.docs_old inherits from public.docs; ON UPDATE CASCADE of foreign key pages_doc_id_fkey of public.pages, which references public.docs_old"},
				{"public", "docs", catalog.PathTruncate, "public.pages", "TRUNCATE", "public.docs_old inherits from public.docs; TRUNCATE ... CASCADE truncates public.pages"},
				{"public", "docs_old", catalog.PathInheritance, "public.docs", "INSERT UPDATE DELETE MERGE TRUNCATE", "public.docs_old inherits from public.docs"},
				{"public", "docs_old", catalog.PathForeignKey, "public.pages", "UPDATE MERGE", "ON UPDATE CASCADE of foreign key pages_doc_id_fkey"},
				{"public", "docs_old", catalog.PathTruncate, "public.pages", "TRUNCATE", "TRUNCATE ... CASCADE truncates public.pages"},
				{"public", "orders", catalog.PathForeignKey, "public.items", "DELETE MERGE",
					"public.orders_1 is a partition of public.orders; ON DELETE CASCADE of foreign key items_order_id_fkey of public.items, which references public.orders_1"},
				// An UPDATE moving a row out of orders_1 deletes it there.
				{"public", "orders", catalog.PathForeignKey, "public.items", "UPDATE",
					"ON DELETE CASCADE of foreign key items_order_id_fkey of public.items, which references public.orders_1 (an UPDATE through the parent that moves the row"},
				{"public", "orders", catalog.PathTruncate, "public.items", "TRUNCATE", "public.orders_1 is a partition of public.orders; TRUNCATE ... CASCADE truncates public.items"},
				{"public", "orders_1", catalog.PathForeignKey, "public.items", "DELETE MERGE", "ON DELETE CASCADE of foreign key items_order_id_fkey"},
				{"public", "orders_1", catalog.PathTruncate, "public.items", "TRUNCATE", "TRUNCATE ... CASCADE truncates public.items"},
				{"public", "orders_1", catalog.PathPartition, "public.orders", "INSERT UPDATE DELETE MERGE TRUNCATE", "public.orders_1 is a partition of public.orders"},
				{"public", "orders_2", catalog.PathPartition, "public.orders", "INSERT UPDATE DELETE MERGE TRUNCATE", "public.orders_2 is a partition of public.orders"},
			},
			proofs: []indirectProof{
				{"DELETE FROM orders", "SELECT count(*) FROM items"},
				{"UPDATE orders SET region = 2", "SELECT count(*) FROM items"},
				{"UPDATE docs SET id = 7", "SELECT doc_id FROM pages"},
			},
		},
		{
			// Rule and trigger DDL could open these: a disabled rule
			// enabled, an INSTEAD NOTHING rule dropped, an INSTEAD OF
			// trigger created on a view that cannot be written now.
			name: "latent paths",
			setup: `
				CREATE TABLE config (id int PRIMARY KEY, x int);
				CREATE TABLE plain (id int PRIMARY KEY, x int);
				CREATE TABLE unrelated (id int PRIMARY KEY, x int);
				CREATE RULE later AS ON UPDATE TO plain DO ALSO UPDATE config SET x = NEW.x;
				ALTER TABLE plain DISABLE RULE later;
				CREATE VIEW quiet AS SELECT * FROM config;
				CREATE RULE nothing AS ON UPDATE TO quiet DO INSTEAD NOTHING;
				CREATE RULE nothing_i AS ON INSERT TO quiet DO INSTEAD NOTHING;
				CREATE RULE nothing_d AS ON DELETE TO quiet DO INSTEAD NOTHING;
				CREATE VIEW summed AS SELECT count(*) AS n FROM config;
				CREATE VIEW elsewhere AS SELECT * FROM unrelated;
				CREATE RULE r AS ON UPDATE TO unrelated DO ALSO NOTHING;`,
			tables: []catalog.Rel{{Schema: "public", Name: "config"}},
			want: []indirectWant{
				{"public", "plain", catalog.PathLatent, "public.config", "", "rule later on public.plain (ON UPDATE DO ALSO) runs UPDATE on public.config"},
				{"public", "quiet", catalog.PathLatent, "public.config", "", "auto-updatable view public.quiet writes public.config"},
				{"public", "summed", catalog.PathLatent, "public.config", "", "view public.summed reads public.config: an INSTEAD OF trigger"},
			},
		},
		{
			// A tree: the key's action writes rows of the table the
			// statement's fence did not check.
			name: "a protected table referencing itself",
			setup: `
				CREATE TABLE comments (id int PRIMARY KEY, parent_id int REFERENCES comments ON DELETE CASCADE);
				CREATE TABLE a (id int PRIMARY KEY, pid int UNIQUE REFERENCES a (id) ON DELETE SET NULL);
				CREATE TABLE config (id int PRIMARY KEY, a_pid int REFERENCES a (pid) ON UPDATE CASCADE);
				INSERT INTO comments VALUES (1, NULL), (2, 1);
				INSERT INTO a VALUES (1, NULL), (2, 1); INSERT INTO config VALUES (1, 1);`,
			tables: []catalog.Rel{{Schema: "public", Name: "comments"}, {Schema: "public", Name: "config"}},
			want: []indirectWant{
				// DELETE FROM a sets a.pid to NULL, an UPDATE of the key
				// config follows.
				{"public", "a", catalog.PathForeignKey, "public.config", "DELETE MERGE",
					"ON DELETE SET NULL of foreign key a_pid_fkey of public.a, which references public.a; ON UPDATE CASCADE of foreign key config_a_pid_fkey"},
				{"public", "a", catalog.PathForeignKey, "public.config", "UPDATE MERGE", "ON UPDATE CASCADE of foreign key config_a_pid_fkey"},
				{"public", "a", catalog.PathTruncate, "public.config", "TRUNCATE", "TRUNCATE ... CASCADE truncates public.config"},
				{"public", "comments", catalog.PathForeignKey, "public.comments", "DELETE MERGE", "ON DELETE CASCADE of foreign key comments_parent_id_fkey of public.comments, which references public.comments"},
			},
			proofs: []indirectProof{
				{"DELETE FROM comments WHERE id = 1", "SELECT count(*) FROM comments"},
				{"DELETE FROM a WHERE id = 1", "SELECT count(a_pid) FROM config"},
			},
		},
		{
			name: "ON CONFLICT DO UPDATE in a rule action",
			setup: `
				CREATE TABLE owner (id int PRIMARY KEY, n int NOT NULL DEFAULT 0);
				CREATE TABLE config (id int PRIMARY KEY, owner_id int REFERENCES owner ON UPDATE CASCADE);
				CREATE TABLE requests (id int);
				CREATE TABLE other (id int);
				CREATE RULE upsert AS ON INSERT TO requests
					DO ALSO INSERT INTO owner VALUES (NEW.id) ON CONFLICT (id) DO UPDATE SET id = EXCLUDED.id + 100;
				CREATE RULE quiet AS ON INSERT TO other
					DO ALSO INSERT INTO owner VALUES (NEW.id) ON CONFLICT (id) DO NOTHING;
				INSERT INTO owner VALUES (1); INSERT INTO config VALUES (1, 1);`,
			tables: []catalog.Rel{{Schema: "public", Name: "config"}},
			want: []indirectWant{
				// A plain INSERT into owner runs no action: UPDATE only.
				{"public", "owner", catalog.PathForeignKey, "public.config", "UPDATE MERGE",
					"ON UPDATE CASCADE of foreign key config_owner_id_fkey of public.config, which references public.owner"},
				{"public", "owner", catalog.PathTruncate, "public.config", "TRUNCATE", "TRUNCATE ... CASCADE truncates public.config"},
				{"public", "requests", catalog.PathRule, "public.config", "INSERT",
					"rule upsert on public.requests (ON INSERT DO ALSO) runs UPDATE on public.owner; ON UPDATE CASCADE of foreign key config_owner_id_fkey"},
			},
			proofs: []indirectProof{
				{"INSERT INTO requests VALUES (1)", "SELECT owner_id FROM config"},
			},
		},
		{
			name: "partitions",
			setup: `
				CREATE TABLE root (region text, year int, x int) PARTITION BY LIST (region);
				CREATE TABLE mid PARTITION OF root FOR VALUES IN ('eu') PARTITION BY RANGE (year);
				CREATE TABLE leaf PARTITION OF mid FOR VALUES FROM (2020) TO (2030);
				CREATE TABLE sibling PARTITION OF mid FOR VALUES FROM (2030) TO (2040);
				CREATE TABLE us PARTITION OF root FOR VALUES IN ('us');
				-- Partitions of a protected partitioned table hold its rows.
				CREATE TABLE events (day int, x int) PARTITION BY RANGE (day);
				CREATE TABLE events_1 PARTITION OF events FOR VALUES FROM (0) TO (100) PARTITION BY RANGE (day);
				CREATE TABLE events_1a PARTITION OF events_1 FOR VALUES FROM (0) TO (50);`,
			tables: []catalog.Rel{{Schema: "public", Name: "leaf"}, {Schema: "public", Name: "events"}},
			want: []indirectWant{
				{"public", "events_1", catalog.PathPartition, "public.events", "INSERT UPDATE DELETE MERGE TRUNCATE", "public.events_1 is a partition of public.events"},
				{"public", "events_1a", catalog.PathPartition, "public.events", "INSERT UPDATE DELETE MERGE TRUNCATE",
					"public.events_1a is a partition of public.events_1; public.events_1 is a partition of public.events"},
				{"public", "mid", catalog.PathPartition, "public.leaf", "INSERT UPDATE DELETE MERGE TRUNCATE", "public.leaf is a partition of public.mid"},
				{"public", "root", catalog.PathPartition, "public.leaf", "INSERT UPDATE DELETE MERGE TRUNCATE",
					"public.mid is a partition of public.root; public.leaf is a partition of public.mid"},
			},
			proofs: []indirectProof{
				{"INSERT INTO root VALUES ('eu', 2024, 1)", "SELECT count(*) FROM leaf"},
				{"INSERT INTO events_1a VALUES (1, 1)", "SELECT count(*) FROM events"},
			},
		},
		{
			name: "inheritance",
			setup: `
				CREATE TABLE base (id int, x int);
				CREATE TABLE config (extra int) INHERITS (base);
				-- Rows of a protected parent's child are rows of the parent.
				CREATE TABLE history (id int);
				CREATE TABLE history_old () INHERITS (history);
				-- A child of two parents: writing it through one parent
				-- writes rows of the other.
				CREATE TABLE drafts (id int);
				CREATE TABLE history_draft () INHERITS (drafts, history);
				INSERT INTO config VALUES (1, 1, 1); INSERT INTO history_draft VALUES (1);`,
			tables: []catalog.Rel{{Schema: "public", Name: "config"}, {Schema: "public", Name: "history"}},
			want: []indirectWant{
				{"public", "base", catalog.PathInheritance, "public.config", "UPDATE DELETE MERGE TRUNCATE", "public.config inherits from public.base"},
				{"public", "drafts", catalog.PathInheritance, "public.history", "UPDATE DELETE MERGE TRUNCATE",
					"public.history_draft inherits from public.drafts; public.history_draft inherits from public.history"},
				{"public", "history_draft", catalog.PathInheritance, "public.history", "INSERT UPDATE DELETE MERGE TRUNCATE", "public.history_draft inherits from public.history"},
				{"public", "history_old", catalog.PathInheritance, "public.history", "INSERT UPDATE DELETE MERGE TRUNCATE", "public.history_old inherits from public.history"},
			},
			proofs: []indirectProof{
				{"UPDATE base SET x = 2", "SELECT x FROM config"},
				{"DELETE FROM drafts", "SELECT count(*) FROM history"},
			},
		},
		{
			name: "foreign keys",
			setup: `
				CREATE TABLE account (id int PRIMARY KEY);
				CREATE TABLE project (id int PRIMARY KEY, account_id int REFERENCES account ON DELETE CASCADE);
				CREATE TABLE owner (id int PRIMARY KEY);
				CREATE TABLE audit (id int PRIMARY KEY);
				CREATE TABLE config (
					id int PRIMARY KEY,
					project_id int REFERENCES project ON DELETE CASCADE,
					owner_id int REFERENCES owner ON UPDATE SET NULL,
					audit_id int REFERENCES audit -- NO ACTION
				);
				INSERT INTO account VALUES (1); INSERT INTO project VALUES (1, 1);
				INSERT INTO owner VALUES (1); INSERT INTO audit VALUES (1);
				INSERT INTO config VALUES (1, 1, 1, 1);`,
			tables: []catalog.Rel{{Schema: "public", Name: "config"}},
			want: []indirectWant{
				{"public", "account", catalog.PathForeignKey, "public.config", "DELETE MERGE",
					"ON DELETE CASCADE of foreign key project_account_id_fkey of public.project, which references public.account; ON DELETE CASCADE of foreign key config_project_id_fkey of public.config, which references public.project"},
				{"public", "account", catalog.PathTruncate, "public.config", "TRUNCATE",
					"TRUNCATE ... CASCADE truncates public.project, whose foreign key project_account_id_fkey references public.account; TRUNCATE ... CASCADE truncates public.config, whose foreign key config_project_id_fkey references public.project"},
				// NO ACTION: no foreign key path, but TRUNCATE ... CASCADE.
				{"public", "audit", catalog.PathTruncate, "public.config", "TRUNCATE",
					"TRUNCATE ... CASCADE truncates public.config, whose foreign key config_audit_id_fkey references public.audit"},
				{"public", "owner", catalog.PathForeignKey, "public.config", "UPDATE MERGE",
					"ON UPDATE SET NULL of foreign key config_owner_id_fkey of public.config, which references public.owner"},
				{"public", "owner", catalog.PathTruncate, "public.config", "TRUNCATE",
					"TRUNCATE ... CASCADE truncates public.config, whose foreign key config_owner_id_fkey references public.owner"},
				{"public", "project", catalog.PathForeignKey, "public.config", "DELETE MERGE",
					"ON DELETE CASCADE of foreign key config_project_id_fkey of public.config, which references public.project"},
				{"public", "project", catalog.PathTruncate, "public.config", "TRUNCATE",
					"TRUNCATE ... CASCADE truncates public.config, whose foreign key config_project_id_fkey references public.project"},
			},
			proofs: []indirectProof{
				{"DELETE FROM account", "SELECT count(*) FROM config"},
				{"UPDATE owner SET id = 2", "SELECT owner_id FROM config"},
				// INSERT ... ON CONFLICT DO UPDATE is an UPDATE too.
				{"INSERT INTO owner VALUES (1) ON CONFLICT (id) DO UPDATE SET id = 3", "SELECT owner_id FROM config"},
				{"TRUNCATE audit CASCADE", "SELECT count(*) FROM config"},
			},
		},
		{
			name: "partitioned foreign keys",
			setup: `
				-- Referenced side partitioned: each partition has a clone of
				-- the constraint (config_owner_id_fkey1), and deleting from
				-- it cascades too.
				CREATE TABLE owners (id int PRIMARY KEY) PARTITION BY RANGE (id);
				CREATE TABLE owners_1 PARTITION OF owners FOR VALUES FROM (0) TO (100);
				CREATE TABLE config (id int PRIMARY KEY, owner_id int REFERENCES owners ON DELETE CASCADE);
				-- Referencing side partitioned, its partition protected.
				CREATE TABLE teams (id int PRIMARY KEY);
				CREATE TABLE items (id int, team_id int REFERENCES teams ON DELETE SET NULL) PARTITION BY LIST (id);
				CREATE TABLE items_a PARTITION OF items FOR VALUES IN (1);
				INSERT INTO owners VALUES (1); INSERT INTO config VALUES (1, 1);
				INSERT INTO teams VALUES (1); INSERT INTO items VALUES (1, 1);`,
			tables: []catalog.Rel{{Schema: "public", Name: "config"}, {Schema: "public", Name: "items_a"}},
			want: []indirectWant{
				{"public", "items", catalog.PathPartition, "public.items_a", "INSERT UPDATE DELETE MERGE TRUNCATE", "public.items_a is a partition of public.items"},
				{"public", "owners", catalog.PathForeignKey, "public.config", "DELETE MERGE",
					"ON DELETE CASCADE of foreign key config_owner_id_fkey of public.config, which references public.owners"},
				{"public", "owners", catalog.PathTruncate, "public.config", "TRUNCATE",
					"TRUNCATE ... CASCADE truncates public.config, whose foreign key config_owner_id_fkey references public.owners"},
				{"public", "owners_1", catalog.PathForeignKey, "public.config", "DELETE MERGE",
					"ON DELETE CASCADE of foreign key config_owner_id_fkey1 of public.config, which references public.owners_1"},
				{"public", "owners_1", catalog.PathTruncate, "public.config", "TRUNCATE",
					"TRUNCATE ... CASCADE truncates public.config, whose foreign key config_owner_id_fkey1 references public.owners_1"},
				{"public", "teams", catalog.PathForeignKey, "public.items_a", "DELETE MERGE",
					"ON DELETE SET NULL of foreign key items_team_id_fkey of public.items, which references public.teams; public.items_a is a partition of public.items"},
				{"public", "teams", catalog.PathTruncate, "public.items_a", "TRUNCATE",
					"TRUNCATE ... CASCADE truncates public.items_a, whose foreign key items_team_id_fkey references public.teams"},
			},
			proofs: []indirectProof{
				{"DELETE FROM owners_1", "SELECT count(*) FROM config"},
				{"DELETE FROM teams", "SELECT team_id FROM items_a"},
				{"TRUNCATE teams CASCADE", "SELECT count(*) FROM items_a"},
			},
		},
		{
			name: "steps combine",
			setup: `
				CREATE TABLE root (day int, x int) PARTITION BY RANGE (day);
				CREATE TABLE config PARTITION OF root FOR VALUES FROM (0) TO (100);
				CREATE VIEW recent AS SELECT * FROM root WHERE day > 10;
				CREATE TABLE inbox (day int, x int);
				CREATE RULE forward AS ON INSERT TO inbox DO INSTEAD INSERT INTO recent VALUES (NEW.day, NEW.x);
				-- ONLY root: a DELETE through the view reaches no partition,
				-- but an INSERT still routes.
				CREATE VIEW root_only AS SELECT * FROM ONLY root;`,
			tables: []catalog.Rel{{Schema: "public", Name: "config"}},
			want: []indirectWant{
				{"public", "inbox", catalog.PathRule, "public.config", "INSERT",
					"rule forward on public.inbox (ON INSERT DO INSTEAD) runs INSERT on public.recent; auto-updatable view public.recent writes public.root; public.config is a partition of public.root"},
				{"public", "recent", catalog.PathView, "public.config", "INSERT UPDATE DELETE",
					"auto-updatable view public.recent writes public.root; public.config is a partition of public.root"},
				{"public", "root", catalog.PathPartition, "public.config", "INSERT UPDATE DELETE MERGE TRUNCATE", "public.config is a partition of public.root"},
				{"public", "root_only", catalog.PathView, "public.config", "INSERT",
					"auto-updatable view public.root_only writes public.root; public.config is a partition of public.root"},
			},
			proofs: []indirectProof{
				{"INSERT INTO inbox VALUES (20, 1)", "SELECT count(*) FROM config"},
				{"INSERT INTO root_only VALUES (20, 1)", "SELECT count(*) FROM config"},
			},
		},
		{
			name: "quoted names",
			setup: `
				CREATE SCHEMA "My Schema";
				CREATE TABLE "My Schema"."Config" (id int PRIMARY KEY, "x""y" int);
				-- Names full of the node tree's own punctuation.
				CREATE VIEW "My Schema"."V (1)" AS SELECT id AS ":relid 99", "x""y" AS "}{)( \" FROM "My Schema"."Config";
				CREATE TABLE "Parent" (id int PRIMARY KEY);
				ALTER TABLE "My Schema"."Config" ADD CONSTRAINT "Fk" FOREIGN KEY (id) REFERENCES "Parent" ON DELETE CASCADE;
				CREATE TABLE a$b (id int);
				CREATE RULE "Rule!" AS ON INSERT TO a$b DO ALSO DELETE FROM "My Schema"."Config";
				INSERT INTO "Parent" VALUES (1); INSERT INTO "My Schema"."Config" VALUES (1, 1);`,
			tables: []catalog.Rel{{Schema: "My Schema", Name: "Config"}},
			want: []indirectWant{
				{"My Schema", "V (1)", catalog.PathView, `"My Schema"."Config"`, "INSERT UPDATE DELETE", `auto-updatable view "My Schema"."V (1)" writes "My Schema"."Config"`},
				{"public", "Parent", catalog.PathForeignKey, `"My Schema"."Config"`, "DELETE MERGE",
					`ON DELETE CASCADE of foreign key "Fk" of "My Schema"."Config", which references public."Parent"`},
				{"public", "Parent", catalog.PathTruncate, `"My Schema"."Config"`, "TRUNCATE", `foreign key "Fk" references public."Parent"`},
				{"public", "a$b", catalog.PathRule, `"My Schema"."Config"`, "INSERT", `rule "Rule!" on public.a$b (ON INSERT DO ALSO) runs DELETE on "My Schema"."Config"`},
			},
			proofs: []indirectProof{
				{`UPDATE "My Schema"."V (1)" SET "}{)( \" = 7`, `SELECT "x""y" FROM "My Schema"."Config"`},
				{`DELETE FROM "Parent"`, `SELECT count(*) FROM "My Schema"."Config"`},
			},
		},
		{
			name:   "missing table",
			setup:  `CREATE TABLE t (id int); CREATE VIEW v AS SELECT * FROM t;`,
			tables: []catalog.Rel{{Schema: "public", Name: "nosuch"}, {Schema: "public", Name: "t"}},
			want:   []indirectWant{{"public", "v", catalog.PathView, "public.t", "INSERT UPDATE DELETE", "auto-updatable view public.v writes public.t"}},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			conn := connect(t, newDatabase(t))
			execSQL(t, conn, tc.setup)
			got, err := catalog.IndirectPaths(t.Context(), conn, tc.tables)
			if err != nil {
				t.Fatal(err)
			}
			checkIndirect(t, got, tc.want)
			for _, p := range tc.proofs {
				indirectProve(t, conn, p)
			}
		})
	}

	// An ON UPDATE action as the first step names the referenced key's
	// columns, unless a BEFORE UPDATE row trigger (enabled or not) may
	// change the key whatever the UPDATE sets; an ON DELETE action none.
	t.Run("columns of an ON UPDATE action", func(t *testing.T) {
		conn := connect(t, newDatabase(t))
		execSQL(t, conn, `
			CREATE TABLE owner (id int, "Code" text, name text, PRIMARY KEY (id, "Code"));
			CREATE TABLE config (id int PRIMARY KEY, owner_id int, owner_code text,
				FOREIGN KEY (owner_id, owner_code) REFERENCES owner ON UPDATE CASCADE ON DELETE CASCADE);
			CREATE TABLE other (id int PRIMARY KEY);
			CREATE TABLE config2 (id int PRIMARY KEY REFERENCES other ON UPDATE SET NULL);`)
		cols := func() map[string]string {
			got, err := catalog.IndirectPaths(t.Context(), conn, []catalog.Rel{{Schema: "public", Name: "config"}, {Schema: "public", Name: "config2"}})
			if err != nil {
				t.Fatal(err)
			}
			out := map[string]string{}
			for _, p := range got {
				if p.Kind == catalog.PathForeignKey {
					out[p.Name+" "+strings.Join(p.Ops, " ")] = strings.Join(p.Columns, ",")
				}
			}
			return out
		}
		want := map[string]string{"owner DELETE MERGE": "", "owner UPDATE MERGE": "id,Code", "other UPDATE MERGE": "id"}
		if got := cols(); fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("columns: %v, want %v", got, want)
		}
		execSQL(t, conn, `CREATE FUNCTION bump() RETURNS trigger LANGUAGE plpgsql AS 'BEGIN NEW.id := NEW.id + 1; RETURN NEW; END';
			CREATE TRIGGER bump BEFORE UPDATE ON other FOR EACH ROW EXECUTE FUNCTION bump();
			ALTER TABLE other DISABLE TRIGGER bump;`)
		want["other UPDATE MERGE"] = ""
		if got := cols(); fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("with a BEFORE UPDATE trigger: %v, want %v", got, want)
		}
	})

	// A stored generated key column changes with the columns it is
	// computed from, in the referenced table or any descendant; a BEFORE
	// UPDATE row trigger of a partition alone runs for rows updated
	// through the parent.
	t.Run("columns of an ON UPDATE action, generated key and partitions", func(t *testing.T) {
		conn := connect(t, newDatabase(t))
		execSQL(t, conn, `
			CREATE TABLE owner (id int PRIMARY KEY, a int, b int, ref int GENERATED ALWAYS AS (id * 10 + a) STORED UNIQUE);
			CREATE TABLE config (id int PRIMARY KEY, owner_ref int REFERENCES owner (ref) ON UPDATE CASCADE);
			CREATE TABLE other (id int PRIMARY KEY, note text) PARTITION BY RANGE (id);
			CREATE TABLE other_1 PARTITION OF other FOR VALUES FROM (0) TO (100);
			CREATE TABLE config2 (id int PRIMARY KEY, other_id int REFERENCES other ON UPDATE SET NULL);
			INSERT INTO owner (id, a) VALUES (1, 1); INSERT INTO config VALUES (1, 11);`)
		cols := func() map[string]string {
			got, err := catalog.IndirectPaths(t.Context(), conn, []catalog.Rel{{Schema: "public", Name: "config"}, {Schema: "public", Name: "config2"}})
			if err != nil {
				t.Fatal(err)
			}
			out := map[string]string{}
			for _, p := range got {
				if p.Kind == catalog.PathForeignKey && !strings.Contains(p.Via, "is a partition of") {
					out[p.Name] = strings.Join(p.Columns, ",")
				}
			}
			return out
		}
		want := map[string]string{"owner": "ref,a,id", "other": "id", "other_1": "id"}
		if got := cols(); fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("columns: %v, want %v", got, want)
		}
		// The path is real: setting a column ref is computed from moves config.
		tx, err := conn.Begin(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		var moved int
		if _, err := tx.Exec(t.Context(), "UPDATE owner SET a = 2"); err != nil {
			t.Fatal(err)
		}
		if err := tx.QueryRow(t.Context(), "SELECT owner_ref FROM config").Scan(&moved); err != nil || moved != 12 {
			t.Errorf("config.owner_ref after UPDATE owner SET a = 2: %d, %v; want 12", moved, err)
		}
		_ = tx.Rollback(t.Context())
		execSQL(t, conn, `CREATE FUNCTION bump() RETURNS trigger LANGUAGE plpgsql AS 'BEGIN NEW.id := NEW.id + 1; RETURN NEW; END';
			CREATE TRIGGER bump BEFORE UPDATE ON other_1 FOR EACH ROW EXECUTE FUNCTION bump();`)
		want["other"], want["other_1"] = "", ""
		if got := cols(); fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("with a partition's BEFORE UPDATE trigger: %v, want %v", got, want)
		}
	})

	// Which paths a new partition or inheritance child of the relation
	// would take too: its rows are the relation's (a step up to a
	// protected ancestor), and a partition gets the relation's foreign
	// keys' actions; a step down to a protected partition is not taken.
	t.Run("new partitions and children", func(t *testing.T) {
		conn := connect(t, newDatabase(t))
		execSQL(t, conn, `
			CREATE TABLE root (id int, region int) PARTITION BY LIST (region);
			CREATE TABLE root_1 PARTITION OF root FOR VALUES IN (1) PARTITION BY RANGE (id);
			CREATE TABLE events (id int, region int) PARTITION BY LIST (region);
			CREATE TABLE events_1 PARTITION OF events FOR VALUES IN (1);
			CREATE TABLE mid (id int PRIMARY KEY) PARTITION BY RANGE (id);
			CREATE TABLE items (id int PRIMARY KEY, mid_id int REFERENCES mid ON DELETE CASCADE);`)
		got, err := catalog.IndirectPaths(t.Context(), conn, []catalog.Rel{{Schema: "public", Name: "root"}, {Schema: "public", Name: "events_1"}, {Schema: "public", Name: "items"}})
		if err != nil {
			t.Fatal(err)
		}
		flags := map[string]string{}
		for _, p := range got {
			if p.Kind != catalog.PathLatent {
				flags[p.Name+" "+p.Kind] = fmt.Sprint(p.NewPartitions, p.NewChildren)
			}
		}
		want := map[string]string{
			"root_1 partition": "true true", "events partition": "false false",
			"mid foreign key": "true false", "mid truncate cascade": "true false",
		}
		if fmt.Sprint(flags) != fmt.Sprint(want) {
			t.Errorf("new partitions, children: %v, want %v", flags, want)
		}
	})

	// A long chain of foreign keys keeps its first and last steps in Via.
	t.Run("long chain", func(t *testing.T) {
		conn := connect(t, newDatabase(t))
		var b strings.Builder
		b.WriteString("CREATE TABLE t0 (id int PRIMARY KEY);")
		for i := 1; i <= 10; i++ {
			fmt.Fprintf(&b, "CREATE TABLE t%d (id int PRIMARY KEY REFERENCES t%d ON DELETE CASCADE);", i, i-1)
		}
		execSQL(t, conn, b.String())
		got, err := catalog.IndirectPaths(t.Context(), conn, []catalog.Rel{{Schema: "public", Name: "t10"}})
		if err != nil {
			t.Fatal(err)
		}
		step := func(i int) string {
			return fmt.Sprintf("ON DELETE CASCADE of foreign key t%d_id_fkey of public.t%d, which references public.t%d", i, i, i-1)
		}
		want := strings.Join([]string{step(1), step(2), step(3), step(4), "... 2 more steps ...", step(7), step(8), step(9), step(10)}, "; ")
		if len(got) == 0 {
			t.Fatal("no paths")
		}
		if len(got) != 20 || got[0].Name != "t0" || got[0].Kind != catalog.PathForeignKey || got[0].Via != want {
			t.Fatalf("got %d paths, the first %+v; want 20, the first from t0 with Via %q", len(got), got[0], want)
		}
	})

	// Inside the caller's transaction the catalog is read there
	// (uncommitted objects included) and the transaction stays open.
	t.Run("caller's transaction", func(t *testing.T) {
		conn := connect(t, newDatabase(t))
		execSQL(t, conn, "CREATE TABLE config (id int)")
		tx, err := conn.Begin(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback(context.Background()) }()
		if _, err := tx.Exec(t.Context(), "CREATE VIEW v AS SELECT * FROM config"); err != nil {
			t.Fatal(err)
		}
		got, err := catalog.IndirectPaths(t.Context(), conn, []catalog.Rel{{Schema: "public", Name: "config"}})
		if err != nil {
			t.Fatal(err)
		}
		checkIndirect(t, got, []indirectWant{{"public", "v", catalog.PathView, "public.config", "INSERT UPDATE DELETE", "view public.v"}})
		if s := conn.PgConn().TxStatus(); s != 'T' {
			t.Fatalf("transaction status %q after IndirectPaths, want T", s)
		}
		if got, err := catalog.IndirectPaths(t.Context(), conn, nil); err != nil || len(got) != 0 {
			t.Fatalf("no protected tables: got %v, %v; want nothing", got, err)
		}
	})
}

// checkIndirect compares got with want, in order. Latent entries
// (catalog.PathLatent) are compared only where want lists one.
func checkIndirect(t *testing.T, got []catalog.IndirectPath, want []indirectWant) {
	t.Helper()
	if !slices.ContainsFunc(want, func(w indirectWant) bool { return w.kind == catalog.PathLatent }) {
		got = slices.DeleteFunc(slices.Clone(got), func(p catalog.IndirectPath) bool { return p.Kind == catalog.PathLatent })
	}
	ok := len(got) == len(want)
	for i := 0; ok && i < len(got); i++ {
		g, w := got[i], want[i]
		ok = g.Schema == w.schema && g.Name == w.name && g.Kind == w.kind && g.Target == w.target &&
			strings.Join(g.Ops, " ") == w.ops && strings.Contains(g.Via, w.via)
	}
	if !ok {
		var b strings.Builder
		for _, g := range got {
			fmt.Fprintf(&b, "\t{%q, %q, %q, %q, %q, %q}\n", g.Schema, g.Name, g.Kind, g.Target, strings.Join(g.Ops, " "), g.Via)
		}
		t.Errorf("got %d paths:\n%swant %d:\n%v", len(got), b.String(), len(want), want)
	}
}

// indirectProve runs p in a transaction it rolls back, and fails unless the
// write changed what the check query returns.
func indirectProve(t *testing.T, conn *pgx.Conn, p indirectProof) {
	t.Helper()
	ctx := t.Context()
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	read := func() string {
		t.Helper()
		rows, err := tx.Query(ctx, p.check)
		if err != nil {
			t.Fatalf("%s: %v", p.check, err)
		}
		var out []string
		for rows.Next() {
			vals, err := rows.Values()
			if err != nil {
				t.Fatalf("%s: %v", p.check, err)
			}
			out = append(out, fmt.Sprint(vals...))
		}
		if err := rows.Err(); err != nil {
			t.Fatalf("%s: %v", p.check, err)
		}
		return strings.Join(out, ",")
	}
	before := read()
	if _, err := tx.Exec(ctx, p.write); err != nil {
		t.Fatalf("%s: %v", p.write, err)
	}
	if after := read(); after == before {
		t.Errorf("%s did not change the protected table: %s returns %q before and after", p.write, p.check, before)
	}
}
