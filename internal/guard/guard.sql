-- fenceproxy database guard (optional, `fenceproxy setup --guard`): row
-- triggers that apply the proxy's fence inside PostgreSQL, so that writes
-- the proxy cannot see (functions, dynamic SQL, cascades, views, rules,
-- sessions that bypass the proxy) are fenced too. Requires objects.sql.
--
-- This file is a Go text/template. Setup runs the SQL outside the "row"
-- definition as it is, in its transaction; every statement is idempotent.
-- The "row" definition is the body of the row trigger function of one
-- table, fenceproxy."guard_<table>", generated with the table's fence
-- column and settings written into it: PL/pgSQL cannot read or set a
-- column whose name it only has as a string (the generic ways, to_jsonb(OLD)
-- and jsonb_populate_record, convert the whole row, detoasting every wide
-- value, on every write), and every expression costs a trigger call some
-- microseconds in each transaction (PL/pgSQL prepares a function's
-- expressions anew in each transaction), so the fast path is as short as
-- the table's settings allow.

-- Roles whose sessions may write the guarded tables without a token or a
-- lock name (migrations, maintenance), filled from guard.exempt_roles.
CREATE TABLE IF NOT EXISTS fenceproxy.guard_exempt (
	role name PRIMARY KEY
);
REVOKE ALL ON fenceproxy.guard_exempt FROM PUBLIC;
GRANT SELECT ON fenceproxy.guard_exempt TO PUBLIC;

-- guard_exempted() reports whether the session's login role (session_user,
-- which SET ROLE and SECURITY DEFINER functions do not change) is a role
-- listed in fenceproxy.guard_exempt or a member of one, directly or
-- through other roles. pg_has_role is not used: it counts a superuser as a
-- member of every role, which would exempt superusers as soon as one role
-- is listed (list them to exempt them).
CREATE OR REPLACE FUNCTION fenceproxy.guard_exempted() RETURNS boolean
LANGUAGE sql
STABLE
SET search_path = pg_catalog, pg_temp
AS $body$
	WITH RECURSIVE member_of(oid) AS (
		SELECT r.oid FROM pg_catalog.pg_roles r WHERE r.rolname = session_user
		UNION
		SELECT m.roleid FROM pg_catalog.pg_auth_members m JOIN member_of ON m.member = member_of.oid
	)
	SELECT EXISTS (
		SELECT FROM member_of
		JOIN pg_catalog.pg_roles r ON r.oid = member_of.oid
		JOIN fenceproxy.guard_exempt e ON e.role = r.rolname)
$body$;
REVOKE ALL ON FUNCTION fenceproxy.guard_exempted() FROM PUBLIC;

-- guard_truncate() is the BEFORE TRUNCATE statement trigger of a guarded
-- table and of each of its partitions (statement triggers, unlike row
-- triggers, are not inherited by partitions). TG_ARGV[0] is the protected
-- table's display name. TRUNCATE removes every row without looking at the
-- fence column: only exempt sessions may.
CREATE OR REPLACE FUNCTION fenceproxy.guard_truncate() RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $body$
BEGIN
	IF fenceproxy.guard_exempted() THEN
		RETURN NULL;
	END IF;
	RAISE EXCEPTION USING ERRCODE = 'FP003',
		MESSAGE = format('fenceproxy guard: TRUNCATE of protected table %s is not allowed', TG_ARGV[0]),
		DETAIL = 'TRUNCATE removes every row without looking at the fence column.',
		HINT = 'Delete the rows with a fencing token, or truncate as a role the guard exempts (guard.exempt_roles).';
END
$body$;
REVOKE ALL ON FUNCTION fenceproxy.guard_truncate() FROM PUBLIC;

-- guard_triggers records the guard's triggers as setup left them, one row
-- per trigger of a guarded table or of one of its partitions then: the
-- relation, the trigger's name, its function's name (in schema fenceproxy)
-- and type, and the protected table's display name. Setup keeps it in
-- line with the triggers, in its own transaction; only its owner writes
-- it. No OIDs but the relation's, kept as regclass: pg_dump writes it as
-- the relation's name, which a restore turns into the new OID, and
-- pg_upgrade keeps relations' OIDs (it refuses user columns of types such
-- as regprocedure, whose OIDs it does not keep).
CREATE TABLE IF NOT EXISTS fenceproxy.guard_triggers (
	relid   regclass NOT NULL,
	name    name NOT NULL,
	fn      name NOT NULL,
	typ     smallint NOT NULL,
	display text NOT NULL,
	PRIMARY KEY (relid, name)
);
REVOKE ALL ON fenceproxy.guard_triggers FROM PUBLIC;

-- guard_relations records, for each relation of guard_triggers, what else
-- fencing rests on as setup left it: its persistence (an unlogged table
-- loses its rows in a crash, and on standbys), its fence column (name,
-- number and type: renamed, dropped and added again, it would start from
-- nothing), and the BEFORE ROW INSERT or UPDATE triggers that run after
-- the guard's row trigger (trigger names sort the order), each as its
-- name and function: one created later could overwrite the stamp.
CREATE TABLE IF NOT EXISTS fenceproxy.guard_relations (
	relid       regclass PRIMARY KEY,
	persistence "char" NOT NULL,
	col         name,
	colnum      smallint,
	coltype     regtype,
	later       text[] NOT NULL,
	display     text NOT NULL
);
REVOKE ALL ON fenceproxy.guard_relations FROM PUBLIC;

-- guard_ddl() is the function of the event triggers fenceproxy_guard_ddl
-- (ddl_command_end) and fenceproxy_guard_rewrite (table_rewrite: a
-- rewrite of a recorded relation), installed by a superuser's setup.
-- After every command,
-- whatever its spelling and wherever it ran (stored code, dynamic SQL
-- built at run time, DROP OWNED, DROP EXTENSION, DROP SCHEMA ... CASCADE,
-- a direct connection), each trigger guard_triggers records must still be
-- on its relation, with its function and type, enabled, without a WHEN
-- condition or UPDATE OF columns, and each relation guard_relations
-- records as it was. Otherwise the command dropped a guarded
-- table or partition, or dropped, disabled, renamed or replaced its
-- guard, and only an exempt session may do that: anyone else's command is
-- undone (FP003). Setup forgets the triggers it is about to change, and
-- keeps the record as they are when it commits.
CREATE OR REPLACE FUNCTION fenceproxy.guard_ddl() RETURNS event_trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $body$
DECLARE
	gone text;
BEGIN
	IF TG_EVENT = 'table_rewrite' THEN
		-- A rewrite can give every row a new fence (ALTER COLUMN ...
		-- TYPE ... USING 0) without a row trigger firing.
		SELECT g.display INTO gone FROM fenceproxy.guard_relations g
		WHERE g.relid::pg_catalog.oid = pg_catalog.pg_event_trigger_table_rewrite_oid();
	ELSE
		SELECT g.display INTO gone FROM fenceproxy.guard_triggers g
		WHERE NOT EXISTS (SELECT FROM pg_catalog.pg_trigger t
			JOIN pg_catalog.pg_proc p ON p.oid = t.tgfoid
			JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
			WHERE t.tgrelid = g.relid::pg_catalog.oid AND t.tgname = g.name AND n.nspname = 'fenceproxy' AND p.proname = g.fn
				AND t.tgtype = g.typ AND t.tgenabled IN ('O', 'A') AND t.tgqual IS NULL
				AND pg_catalog.cardinality(t.tgattr::pg_catalog.int2[]) = 0)
		ORDER BY 1 LIMIT 1;
		IF gone IS NULL THEN
			SELECT g.display INTO gone FROM fenceproxy.guard_relations g
			LEFT JOIN pg_catalog.pg_class c ON c.oid = g.relid::pg_catalog.oid
			WHERE c.oid IS NULL OR c.relpersistence <> g.persistence
				OR (g.col IS NOT NULL AND NOT EXISTS (SELECT FROM pg_catalog.pg_attribute a
					WHERE a.attrelid = c.oid AND a.attnum = g.colnum AND a.attname = g.col
						AND a.atttypid = g.coltype::pg_catalog.oid AND NOT a.attisdropped))
				OR EXISTS (SELECT FROM pg_catalog.pg_trigger t
					WHERE t.tgrelid = c.oid AND NOT t.tgisinternal AND t.tgenabled <> 'D'
						AND (t.tgtype & 3) = 3 AND (t.tgtype & 20) <> 0 AND t.tgname COLLATE "C" > 'fenceproxy_guard'
						AND pg_catalog.format('%s %s', t.tgname, t.tgfoid::pg_catalog.regprocedure) <> ALL (g.later))
			ORDER BY 1 LIMIT 1;
		END IF;
	END IF;
	-- The owner of schema fenceproxy, setup's role, may: it owns the
	-- guard's functions already, and setup must be able to repair a guard
	-- someone broke.
	IF gone IS NULL OR fenceproxy.guard_exempted()
		OR session_user = (SELECT r.rolname FROM pg_catalog.pg_namespace n JOIN pg_catalog.pg_roles r ON r.oid = n.nspowner
			WHERE n.nspname = 'fenceproxy') THEN
		RETURN;
	END IF;
	RAISE EXCEPTION USING ERRCODE = 'FP003',
		MESSAGE = format('fenceproxy guard: %s would drop protected table %s or weaken its guard', TG_TAG, gone),
		DETAIL = 'The database guard fences every write to the table; only sessions of a role it exempts (guard.exempt_roles) or of the owner of schema fenceproxy may drop the table or its partitions, rewrite it, make it unlogged, rename, drop or retype its fence column, drop, disable or replace the guard''s triggers, or add a BEFORE ROW trigger that runs after the guard''s.',
		HINT = 'Run it as a role listed in guard.exempt_roles, or as the role that runs fenceproxy setup; or first take the table out of the guard''s configuration and run fenceproxy setup --guard, which removes its guard.';
END
$body$;
REVOKE ALL ON FUNCTION fenceproxy.guard_ddl() FROM PUBLIC;

INSERT INTO fenceproxy.meta (key, value) VALUES ('guard', '1')
	ON CONFLICT (key) DO UPDATE SET value = excluded.value;

{{- /*
The row trigger, BEFORE INSERT OR UPDATE OR DELETE FOR EACH ROW, as the
proxy's rewrite and register call fence the table:
  - No valid token, or lock: required and no lock name: an exempt session
    passes untouched. Otherwise, with missing_token: allow (and the lock not
    required) the write passes unfenced and cannot set the fence column (an
    UPDATE keeps it, an INSERT gets 0, as through the proxy); else FP002
    (from register when the lock is required, naming what is missing).
  - Lock fencing (lock: required, or optional and a lock name is set): the
    token is registered for the lock (fenceproxy.register: FP001 for a
    stale token) once per transaction and lock/token pair.
  - UPDATE and DELETE of a row whose fence is above the token (strict: not
    below it): FP001, or with on_stale: skip the row is left alone (RETURN
    NULL: not written, not counted). A NULL fence counts as stale, as in the
    proxy's rewrite.
  - INSERT and UPDATE stamp the row with the token.
A session with a valid token is fenced whether or not it is exempt: the
exemption is from needing a token, and looking it up only on that path
keeps it off the cost of ordinary writes.

The memo (fenceproxy.guard_registered, SET LOCAL) spares a multi-row write
a registration per row; a session could set it by hand to skip the
registration, as it can set any token: fencing guards against stale
holders, not against a client that lies. A savepoint that rolls back undoes
it together with the registration (the advisory lock and the watermark).

The first line is a comment naming the settings the body was generated
for: check quotes it when the configuration has changed since.
*/ -}}
{{define "row"}}
-- {{.Header}}
DECLARE
	tok bigint;
BEGIN
	tok := CASE WHEN current_setting({{lit .TokenSetting}}, true) ~ '^0*[1-9][0-9]{0,17}$'
		THEN current_setting({{lit .TokenSetting}}, true)::bigint END;
	IF tok IS NULL{{if eq .Lock "required"}} OR coalesce(current_setting({{lit .LockSetting}}, true), '') = ''{{end}} THEN
		IF tok IS NULL THEN
			-- 19 digits: valid up to the largest bigint.
			tok := CASE WHEN current_setting({{lit .TokenSetting}}, true) ~ '^0*[1-9][0-9]{18}$'
					AND ltrim(current_setting({{lit .TokenSetting}}, true), '0') COLLATE "C" <= '9223372036854775807'
				THEN current_setting({{lit .TokenSetting}}, true)::bigint END;
		END IF;
		IF tok IS NULL{{if eq .Lock "required"}} OR coalesce(current_setting({{lit .LockSetting}}, true), '') = ''{{end}} THEN
			IF fenceproxy.guard_exempted() THEN
				IF TG_OP = 'DELETE' THEN
					RETURN OLD;
				END IF;
				RETURN NEW;
			END IF;
{{- if eq .Lock "required"}}
			CALL fenceproxy.register({{lit .LockSetting}}, {{lit .TokenSetting}}, true, false, '', {{lit .Display}});
{{- else if .Allow}}
			IF TG_OP = 'DELETE' THEN
				RETURN OLD;
			END IF;
{{- if .Column}}
			IF TG_OP = 'UPDATE' THEN
				NEW.{{.Column}} := OLD.{{.Column}};
			ELSE
				NEW.{{.Column}} := 0;
			END IF;
{{- end}}
			RETURN NEW;
{{- end}}
			RAISE EXCEPTION USING ERRCODE = 'FP002',
				MESSAGE = format('fenceproxy guard: write to protected table %s needs a valid %s (a decimal integer 1..9223372036854775807)', {{lit .Display}}, {{lit .TokenSetting}}),
				DETAIL = CASE WHEN current_setting({{lit .TokenSetting}}, true) IS NULL THEN {{lit .TokenSetting}} || ' is not set.'
					ELSE format('%s is %s.', {{lit .TokenSetting}}, quote_literal(substr(current_setting({{lit .TokenSetting}}, true), 1, 32))) END,
				HINT = format('Set it after acquiring the lock, e.g. SET %s = ''42'' (or SET LOCAL inside the transaction).', {{lit .TokenSetting}});
		END IF;
	END IF;
{{- if eq .Lock "optional"}}
	IF current_setting({{lit .LockSetting}}, true) <> '' THEN
		IF current_setting('fenceproxy.guard_registered', true) IS DISTINCT FROM current_setting({{lit .LockSetting}}, true) || E'\n' || tok THEN
			CALL fenceproxy.register({{lit .LockSetting}}, {{lit .TokenSetting}}, false, false, '', {{lit .Display}});
			PERFORM set_config('fenceproxy.guard_registered', current_setting({{lit .LockSetting}}, true) || E'\n' || tok, true);
		END IF;
	END IF;
{{- else if eq .Lock "required"}}
	IF current_setting('fenceproxy.guard_registered', true) IS DISTINCT FROM current_setting({{lit .LockSetting}}, true) || E'\n' || tok THEN
		CALL fenceproxy.register({{lit .LockSetting}}, {{lit .TokenSetting}}, true, false, '', {{lit .Display}});
		PERFORM set_config('fenceproxy.guard_registered', current_setting({{lit .LockSetting}}, true) || E'\n' || tok, true);
	END IF;
{{- end}}
{{- if .Column}}
	IF TG_OP <> 'INSERT' AND NOT coalesce(OLD.{{.Column}} {{if .Strict}}<{{else}}<={{end}} tok, false) THEN
{{- if .Skip}}
		RETURN NULL;
{{- else}}
		RAISE EXCEPTION USING ERRCODE = 'FP001',
			MESSAGE = format('fenceproxy guard: stale fencing token %s for table %s (stored watermark %s)', tok, {{lit .Display}}, coalesce(OLD.{{.Column}}::text, 'NULL')),
			DETAIL = 'A newer lock holder has written this row; the write was rejected so that its data is not overwritten.',
			HINT = 'Acquire the lock again to get a new fencing token, read the row again, then retry the write.';
{{- end}}
	END IF;
	IF TG_OP = 'DELETE' THEN
		RETURN OLD;
	END IF;
	NEW.{{.Column}} := tok;
	RETURN NEW;
{{- else}}
	IF TG_OP = 'DELETE' THEN
		RETURN OLD;
	END IF;
	RETURN NEW;
{{- end}}
END
{{end}}
