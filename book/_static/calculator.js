// The memory calculator of the static site (the chapter "Choosing a strategy").
//
// window.MULTIGPU_GRID (written at build time by src/multigpu/estimator/calculator.py) holds, for every
// setup, each pipeline rank's phases of a step as straight lines in the per-rank batch b: per
// category but the optimizer's, [const, slope]; the optimizer's state apart, per optimizer and
// rank, with what its step allocates beside it (Adam's temporaries: the "optimizer step" phase,
// which SGD, stepping in place, does not have). This file evaluates them as
// multigpu.estimator.peak.estimate does (the largest phase of the largest rank, each category
// truncated to whole bytes) and searches the largest batch as
// peak.predict_largest_batch does. window.multigpuCalculator exposes both for tests/test_site.py.
(function () {
  "use strict";
  const GRID = window.MULTIGPU_GRID;
  const GiB = 2 ** 30;

  function entryOf(s) {
    const gpus = s.strategy === "single" ? 1 : s.gpus;
    const seq = s.seq_len || GRID.seq_len;
    const long = seq !== GRID.seq_len;
    const tp = !long && (s.strategy === "fsdp" || s.strategy.startsWith("pp-")) ? s.tp : 1;
    const key = [s.model, s.strategy, gpus, tp, s.dtype, s.checkpointing, seq].join("|");
    if (GRID.entries[key]) return GRID.entries[key];
    return {
      error: long
        ? `samples longer than ${GRID.seq_len} tokens are precomputed for ${GRID.long_strategies.join(", ")} ` +
          "(tensor-parallel degree 1), on the GPT models whose position table holds them"
        : "this setting is not in the calculator's grid",
    };
  }

  // what the GPU holds beside the step's tensors: the CUDA context and the GPU's cuBLAS
  // workspaces (calculator.gpu_overhead), for s.gpu, a name of GRID.memory, or an unnamed GPU
  function overheadOf(s) {
    return s.gpu && s.gpu in GRID.gpu_overhead ? GRID.gpu_overhead[s.gpu] : GRID.unnamed_gpu_overhead;
  }

  // what estimate(setup, global batch) answers, b samples per data-parallel rank per micro-batch
  function atBatch(entry, optimizer, b, overhead) {
    const cats = GRID.categories;
    const lined = cats.filter((c) => c !== "optimizer");
    let best = null;
    entry.ranks.forEach((rank, r) => {
      const opt = entry.optimizer[optimizer][r];
      const temporary = entry.step[optimizer][r];
      let peak = null;
      for (const [phase, pairs] of rank.phases) {
        if (phase === GRID.step_phase && !temporary) continue;
        const values = { optimizer: phase === GRID.step_phase ? opt + temporary : opt };
        lined.forEach((c, i) => { values[c] = pairs[2 * i] + pairs[2 * i + 1] * b; });
        let sum = 0;
        for (const c of cats) sum += values[c];
        if (peak === null || sum > peak.sum) peak = { phase, values, sum };
      }
      const bytes = {};
      let total = 0;
      for (const c of cats) { bytes[c] = Math.trunc(peak.values[c]); }
      bytes.other += entry.overhead[optimizer] + overhead;
      for (const c of cats) total += bytes[c];
      bytes.total = total;
      if (best === null || total > best.bytes.total) best = { bytes, phase: peak.phase, rank: rank.rank };
    });
    return {
      per_rank_bytes: best.bytes, phase: best.phase, pipeline_rank: best.rank, per_rank_batch: b,
      global_batch: b * entry.dp * entry.m,
    };
  }

  function answer(s) {
    const entry = entryOf(s);
    if (entry.error) return { error: entry.error };
    const step = entry.dp * entry.m;
    const b = Math.max(1, Math.floor(s.global_batch / step));
    return {
      ...atBatch(entry, s.optimizer, b, overheadOf(s)), dp: entry.dp, pp: entry.pp, tp: entry.tp, cp: entry.cp,
      m: entry.m,
    };
  }

  // estimate.largest_batch: doubling, then bisection, over the per-rank batch
  function largest(s, memoryBytes) {
    const entry = entryOf(s);
    if (entry.error) return { error: entry.error };
    const overhead = overheadOf(s);
    const fits = (k) => atBatch(entry, s.optimizer, k, overhead).per_rank_bytes.total <= memoryBytes;
    if (!fits(1)) return null;
    let lo = 1, hi = 2;
    while (fits(hi)) {
      lo = hi; hi *= 2;
      if (hi > 2 ** 40) return { error: `more than ${lo} samples per rank fit: give the memory of one device` };
    }
    while (hi - lo > 1) {
      const mid = Math.floor((lo + hi) / 2);
      if (fits(mid)) lo = mid; else hi = mid;
    }
    return atBatch(entry, s.optimizer, lo, overhead);
  }

  window.multigpuCalculator = { answer, largest, grid: GRID };

  // -- the page ------------------------------------------------------------------------------
  const root = document.getElementById("multigpu-calculator");
  if (!root || !GRID) return;

  function field(label, input) {
    const wrap = document.createElement("label");
    wrap.className = "mgc-field";
    wrap.append(label, input);
    return wrap;
  }
  function select(name, options, chosen) {
    const el = document.createElement("select");
    el.name = name;
    for (const [value, text] of options) {
      const o = document.createElement("option");
      o.value = String(value); o.textContent = text;
      if (String(value) === String(chosen)) o.selected = true;
      el.append(o);
    }
    return el;
  }
  function number(name, value, min) {
    const el = document.createElement("input");
    el.type = "number"; el.name = name; el.value = value; el.min = min;
    return el;
  }
  const inWords = (n) => (n >= 1e9 ? `${(n / 1e9).toFixed(1)}B` : `${Math.round(n / 1e6)}M`);
  const gib = (bytes) => (bytes / GiB).toFixed(2);

  const inputs = {
    model: select("model", Object.entries(GRID.models).map(([m, n]) => [m, `${m} (${inWords(n)})`]), "t5-3b"),
    strategy: select("strategy", GRID.strategies.map((s) => [s, s]), "fsdp"),
    gpus: select("gpus", GRID.gpus.map((g) => [g, g]), 4),
    tp: select("tp", GRID.tp.map((t) => [t, t]), 1),
    dtype: select("dtype", GRID.dtypes.map((d) => [d, d]), "fp32"),
    optimizer: select("optimizer", GRID.optimizers.map((o) => [o, o]), "adamw"),
    checkpointing: select("checkpointing", GRID.recomputation.map((r) => [r, r]), "none"),
    seq_len: select("seq_len", GRID.seq_lens.map((n) => [n, n]), GRID.seq_len),
    memory: number("memory", 32, 1),
    global_batch: number("global_batch", 8, 1),
  };
  const gpuNames = select("gpu", [["", "(another)"], ...Object.keys(GRID.memory).map((n) => [n, n])], "v100-32gb");
  gpuNames.addEventListener("change", () => {
    if (gpuNames.value) inputs.memory.value = GRID.memory[gpuNames.value] / GiB;
    draw();
  });
  inputs.memory.addEventListener("input", () => {  // a size typed by hand: a GPU the list does not name
    if (gpuNames.value && Number(inputs.memory.value) * GiB !== GRID.memory[gpuNames.value]) gpuNames.value = "";
  });

  const form = document.createElement("div");
  form.className = "mgc-form";
  form.append(
    field("model", inputs.model), field("strategy", inputs.strategy), field("GPUs", inputs.gpus),
    field("tensor-parallel degree (fsdp, pipelines)", inputs.tp), field("precision", inputs.dtype),
    field("optimizer", inputs.optimizer), field("activation recomputation", inputs.checkpointing),
    field("tokens per sample", inputs.seq_len),
    field("GPU", gpuNames), field("memory per GPU, GiB", inputs.memory), field("global batch", inputs.global_batch));
  const bar = document.createElement("div");
  bar.className = "mgc-bar";
  const table = document.createElement("table");
  table.className = "mgc-table";
  const said = document.createElement("p");
  said.className = "mgc-said";
  const made = document.createElement("p");
  made.className = "mgc-made";
  const by = GRID.made_by;
  made.textContent = `Precomputed by multigpu ${by.package} (source ${by.source}, torch ${by.torch}) ` +
    `over ${Object.keys(GRID.entries).length} settings, ${GRID.seq_len} tokens per sample (and ` +
    `${GRID.seq_lens.filter((n) => n !== GRID.seq_len).join(" or ")} for ${GRID.long_strategies.join(", ")}); ` +
    "cp-scratch cuts every sample over all the GPUs; a pipeline runs " +
    `${GRID.microbatches_per_stage} micro-batches per stage. It answers as ` +
    "`python -m multigpu estimate --gpu NAME --uncalibrated` does: a GPU's kernels, its cuBLAS workspaces and " +
    `a CUDA context of ${Math.round(GRID.cuda_context / 2 ** 20)} MiB (assumed) are counted, the allocator's ` +
    "slack is not; for a CPU, ask `python -m multigpu estimate --device cpu`.";
  root.replaceChildren(form, bar, table, said, made);

  function settings() {
    return {
      model: inputs.model.value, strategy: inputs.strategy.value, gpus: Number(inputs.gpus.value),
      tp: Number(inputs.tp.value), dtype: inputs.dtype.value, optimizer: inputs.optimizer.value,
      checkpointing: inputs.checkpointing.value, global_batch: Math.max(1, Number(inputs.global_batch.value) || 1),
      seq_len: Number(inputs.seq_len.value),
      gpu: gpuNames.value || null,
    };
  }

  function draw() {
    const s = settings();
    const memory = Math.max(0, Number(inputs.memory.value) || 0) * GiB;
    const found = answer(s);
    bar.replaceChildren(); table.replaceChildren();
    root.dataset.error = found.error || "";
    if (found.error) {
      said.textContent = `The estimator refuses this setting: ${found.error}`;
      return;
    }
    const bytes = found.per_rank_bytes;
    const scale = Math.max(bytes.total, memory) || 1;
    for (const c of GRID.categories) {
      const part = document.createElement("div");
      part.className = "mgc-part";
      part.style.width = `${(100 * bytes[c]) / scale}%`;
      part.style.background = GRID.colors[c];
      part.title = `${c}: ${gib(bytes[c])} GiB`;
      bar.append(part);
    }
    const line = document.createElement("div");
    line.className = "mgc-memory";
    line.style.left = `${(100 * memory) / scale}%`;
    line.title = `memory per GPU: ${gib(memory)} GiB`;
    bar.append(line);
    const head = table.insertRow();
    for (const h of ["", ...GRID.categories, "total"]) {
      const cell = head.insertCell();
      cell.textContent = h;
      if (GRID.colors[h]) cell.style.borderBottom = `4px solid ${GRID.colors[h]}`;
    }
    const row = table.insertRow();
    row.insertCell().textContent = "GiB per GPU";
    for (const c of [...GRID.categories, "total"]) {
      const cell = row.insertCell();
      cell.textContent = gib(bytes[c]);
      cell.dataset.category = c; cell.dataset.bytes = String(bytes[c]);
    }
    const fit = largest(s, memory);
    const where = found.pipeline_rank === null ? "" : ` of pipeline rank ${found.pipeline_rank}`;
    const grid = `dp ${found.dp} x pp ${found.pp} x tp ${found.tp}` + (found.cp > 1 ? ` x cp ${found.cp}` : "") +
      (found.m > 1 ? `, ${found.m} micro-batches` : "");
    let most;
    if (fit === null) most = "not even one sample per rank fits";
    else if (fit.error) most = fit.error;
    else most = `the largest global batch that fits is ${fit.global_batch} (${fit.per_rank_batch} per rank per micro-batch)`;
    said.textContent = `Global batch ${found.global_batch} on ${grid}: ${found.per_rank_batch} per rank per ` +
      `micro-batch; the peak${where} falls at "${found.phase}", ${gib(bytes.total)} GiB ` +
      `${bytes.total <= memory ? "fits in" : "exceeds"} ${gib(memory)} GiB; ${most}.`;
    root.dataset.total = String(bytes.total);
    root.dataset.largest = fit && !fit.error ? String(fit.global_batch) : "";
  }

  for (const el of [...Object.values(inputs)]) el.addEventListener("input", draw);
  draw();
})();
