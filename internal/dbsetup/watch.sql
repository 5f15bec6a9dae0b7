-- fenceproxy catalog watch: event triggers that count the changes of the
-- catalog that may open a new path to a protected table (a view, a rule,
-- an inheritance or partition parent, a foreign key with a cascading
-- action), so that the proxy sees them before it forwards a write that
-- could take one. Installed by `fenceproxy setup` when its role is a
-- superuser (only superusers may create event triggers), after
-- objects.sql; every statement is idempotent.

-- One row: stamp counts the changes. A change made in a transaction counts
-- when the transaction commits, as the change itself does, so a stamp read
-- in a snapshot describes the catalog of that snapshot.
CREATE TABLE IF NOT EXISTS fenceproxy.catalog (
	one     boolean PRIMARY KEY DEFAULT true CHECK (one),
	stamp   bigint NOT NULL,
	changed timestamptz NOT NULL DEFAULT pg_catalog.now()
);
REVOKE ALL ON fenceproxy.catalog FROM PUBLIC;
GRANT SELECT ON fenceproxy.catalog TO PUBLIC;
INSERT INTO fenceproxy.catalog (one, stamp) VALUES (true, 0) ON CONFLICT (one) DO NOTHING;
-- writer is the transaction (txid_current) that last moved the stamp, and
-- base the stamp before that transaction's first change: while it runs,
-- its own statements compare base (catalog_is), as the proxy's checks,
-- which cannot see its changes before it commits, do.
ALTER TABLE fenceproxy.catalog ADD COLUMN IF NOT EXISTS base bigint, ADD COLUMN IF NOT EXISTS writer bigint;

-- catalog_changed() is the function of both event triggers. It counts
-- every command except those that cannot open a path (of indexes and
-- statistics objects only, comments, privileges, materialized view
-- refreshes) and those on this
-- session's temporary tables and other temporary objects that no other
-- session can write through (its temporary views, and their rules and
-- triggers, count: a view has no storage, and another session can write
-- through it by its schema's name; so do its temporary functions and
-- procedures, which it calls as pg_temp's and which may read a
-- lock-fenced table, so that lock fencing registers for their calls),
-- and notifies fenceproxy_catalog so that proxies check again at once.
-- ddl_command_end reports no objects for DROP: sql_drop counts those (a
-- dropped rule or INSTEAD OF trigger can make a view updatable). A
-- deleted row is recreated; the proxy compares stamps for equality.
-- Concurrent transactions that change the catalog wait for each other at
-- the row, until the first one ends.
CREATE OR REPLACE FUNCTION fenceproxy.catalog_changed() RETURNS event_trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $body$
BEGIN
	IF TG_EVENT = 'sql_drop' THEN
		IF NOT EXISTS (SELECT FROM pg_event_trigger_dropped_objects()
				WHERE (NOT is_temporary OR object_type IN ('view', 'rule', 'trigger'))
					AND object_type NOT IN ('index', 'index column', 'statistics object')) THEN
			RETURN;
		END IF;
	ELSIF TG_TAG IN ('COMMENT', 'GRANT', 'REVOKE', 'ALTER DEFAULT PRIVILEGES', 'SECURITY LABEL',
			'REFRESH MATERIALIZED VIEW')
		-- ALTER INDEX ... RENAME renames any relation, a view or a table
		-- too: these tags count unless every object is an index or
		-- statistics object.
		OR (TG_TAG IN ('CREATE INDEX', 'ALTER INDEX', 'REINDEX', 'CREATE STATISTICS', 'ALTER STATISTICS')
			AND NOT EXISTS (SELECT FROM pg_event_trigger_ddl_commands()
				WHERE object_type NOT IN ('index', 'index column', 'statistics object')))
		OR NOT EXISTS (SELECT FROM pg_event_trigger_ddl_commands()
			WHERE schema_name IS DISTINCT FROM 'pg_temp' OR object_type IN ('view', 'rule', 'trigger', 'function', 'procedure')) THEN
		RETURN;
	END IF;
	-- A plain UPDATE, not an upsert: ON CONFLICT DO UPDATE locks the row
	-- first, and the lock stays in the new version's xmax, which
	-- catalog_is would read as a later change.
	UPDATE fenceproxy.catalog c SET stamp = c.stamp + 1, changed = pg_catalog.now(),
		base = CASE WHEN c.writer = pg_catalog.txid_current() THEN c.base ELSE c.stamp END,
		writer = pg_catalog.txid_current();
	IF NOT FOUND THEN
		INSERT INTO fenceproxy.catalog (one, stamp, writer) VALUES (true, 1, pg_catalog.txid_current())
			ON CONFLICT (one) DO NOTHING;
	END IF;
	PERFORM pg_catalog.pg_notify('fenceproxy_catalog', '');
END
$body$;
REVOKE ALL ON FUNCTION fenceproxy.catalog_changed() FROM PUBLIC;

-- catalog_is(stamp) is the check proxies before catalog_at (below) run in
-- a write's transaction just before the write, with the stamp its paths
-- were read under (its source must stay as it is: they compare it): it
-- raises FP003 when the catalog the write will be planned with may differ
-- from that one. The stamp is read in the CALL's snapshot, so under READ
-- COMMITTED it counts every change committed before the CALL. Under
-- REPEATABLE READ and SERIALIZABLE the snapshot is the transaction's,
-- older than the catalog (which is always read as of now): a stamp row
-- whose visible version was replaced by a committed transaction (its xmax
-- committed) moved after the snapshot. The transaction's own changes are
-- compared as committed: base, the stamp before them.
CREATE OR REPLACE PROCEDURE fenceproxy.catalog_is(want bigint)
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $check$
DECLARE
	s bigint;
	b bigint;
	w bigint;
	x xid;
	ref bigint;
	wide bigint;
	moved boolean := false;
BEGIN
	SELECT c.stamp, c.base, c.writer, c.xmax INTO s, b, w, x FROM fenceproxy.catalog c;
	IF w = txid_current_if_assigned() THEN
		s := b;
	ELSIF x <> '0'::xid AND current_setting('transaction_isolation') <> 'read committed' THEN
		BEGIN
			-- xmax is 32 bits: its epoch is the snapshot's, or the one
			-- next to it.
			ref := txid_snapshot_xmax(txid_current_snapshot());
			wide := (ref >> 32 << 32) + x::text::bigint;
			IF wide > ref + 2147483648 THEN
				wide := wide - 4294967296;
			ELSIF wide < ref - 2147483648 THEN
				wide := wide + 4294967296;
			END IF;
			moved := txid_status(wide) IS NOT DISTINCT FROM 'committed';
		EXCEPTION WHEN OTHERS THEN
			moved := true;
		END;
	END IF;
	IF s IS DISTINCT FROM want OR moved THEN
		RAISE EXCEPTION 'fenceproxy: the catalog of database % changed since the proxy checked it; the statement did not run', current_database()
			USING ERRCODE = 'FP003',
				DETAIL = format('The proxy decided it with the paths to protected tables of catalog stamp %s; the stamp is now %s.',
					want, coalesce(CASE WHEN moved THEN 'newer than this transaction''s snapshot' ELSE s::text END, 'unknown')),
				HINT = 'Retry it: the proxy checks the database again before it decides the retry.';
	END IF;
END
$check$;
GRANT EXECUTE ON PROCEDURE fenceproxy.catalog_is(bigint) TO PUBLIC;

-- catalog_at(stamp) is the check this version of the proxy runs:
-- catalog_is with the same outcome in every case (the same error), its
-- common case first and cheap (about two thirds of catalog_is's server
-- instructions, in callgrind). The common case is one scan that finds the
-- row with stamp want, of a version that no transaction has replaced or
-- locked (xmax 0, under READ COMMITTED too, where catalog_is does not
-- look) and that this transaction did not write: catalog_is would find
-- the stamp equal and no later change. Every other case takes
-- catalog_is's steps, after it. It sets no search_path (a SET in the
-- definition costs as much again as the scan): every name is qualified,
-- operators and types too, so that the caller's search_path cannot change
-- what it runs. catalog_is stays for proxies of earlier versions. Where
-- the row's version was replaced by a transaction still under way (a
-- change of the catalog not yet committed), it also sets lock_timeout for
-- the rest of the transaction, which catalog_is does not: see below.
CREATE OR REPLACE PROCEDURE fenceproxy.catalog_at(want bigint)
LANGUAGE plpgsql
AS $at$
DECLARE
	s bigint;
	b bigint;
	w bigint;
	x pg_catalog.xid;
	ref bigint;
	wide bigint;
	moved boolean := false;
	st pg_catalog.text;
	v pg_catalog.text;
BEGIN
	PERFORM FROM fenceproxy.catalog c
		WHERE c.stamp OPERATOR(pg_catalog.=) want AND c.xmax OPERATOR(pg_catalog.=) '0'::pg_catalog.xid
			AND (c.writer OPERATOR(pg_catalog.=) pg_catalog.txid_current_if_assigned()) IS NOT TRUE;
	IF FOUND THEN
		RETURN;
	END IF;
	SELECT c.stamp, c.base, c.writer, c.xmax INTO s, b, w, x FROM fenceproxy.catalog c;
	IF w OPERATOR(pg_catalog.=) pg_catalog.txid_current_if_assigned() THEN
		s := b;
	ELSIF x OPERATOR(pg_catalog.<>) '0'::pg_catalog.xid THEN
		BEGIN
			ref := pg_catalog.txid_snapshot_xmax(pg_catalog.txid_current_snapshot());
			wide := (ref OPERATOR(pg_catalog.>>) 32 OPERATOR(pg_catalog.<<) 32)
				OPERATOR(pg_catalog.+) x::pg_catalog.text::bigint;
			IF wide OPERATOR(pg_catalog.>) (ref OPERATOR(pg_catalog.+) 2147483648) THEN
				wide := wide OPERATOR(pg_catalog.-) 4294967296;
			ELSIF wide OPERATOR(pg_catalog.<) (ref OPERATOR(pg_catalog.-) 2147483648) THEN
				wide := wide OPERATOR(pg_catalog.+) 4294967296;
			END IF;
			st := pg_catalog.txid_status(wide);
		EXCEPTION WHEN OTHERS THEN
			st := NULL;
		END;
		IF st IS NULL OR st OPERATOR(pg_catalog.=) 'in progress' THEN
			-- Another transaction has changed the catalog and not ended:
			-- a statement after this check that waited for one of its
			-- locks would run, once it commits, with a catalog the proxy
			-- did not check. For the rest of this transaction a lock that
			-- cannot be had within a millisecond fails the statement
			-- (55P03) instead, and the client's retry is decided with the
			-- catalog as it is then.
			v := pg_catalog.set_config('lock_timeout', '1ms', true);
		END IF;
		IF pg_catalog.current_setting('transaction_isolation') OPERATOR(pg_catalog.<>) 'read committed' THEN
			moved := st IS NULL OR st OPERATOR(pg_catalog.=) 'committed';
		END IF;
	END IF;
	IF (s OPERATOR(pg_catalog.=) want) IS NOT TRUE OR moved THEN
		RAISE EXCEPTION 'fenceproxy: the catalog of database % changed since the proxy checked it; the statement did not run', pg_catalog.current_database()
			USING ERRCODE = 'FP003',
				DETAIL = pg_catalog.format('The proxy decided it with the paths to protected tables of catalog stamp %s; the stamp is now %s.',
					want, coalesce(CASE WHEN moved THEN 'newer than this transaction''s snapshot' ELSE s::pg_catalog.text END, 'unknown')),
				HINT = 'Retry it: the proxy checks the database again before it decides the retry.';
	END IF;
END
$at$;
GRANT EXECUTE ON PROCEDURE fenceproxy.catalog_at(bigint) TO PUBLIC;
