--- The 'native' renderer: Neovim 0.12's vim.lsp.inline_completion shows and accepts suggestions;
--- this module adds partial accepts and per-buffer enabling on top of its public API.

local text = require('specd.text')
local util = require('specd.util')

local M = {}

M.namespace = 'nvim.lsp.inline_completion'

---@param _client vim.lsp.Client
---@param bufnr integer
---@param enabled boolean
function M.attach(_client, bufnr, enabled)
  vim.lsp.inline_completion.enable(enabled, { bufnr = bufnr })
end

function M.detach(_bufnr) end

---@param bufnr integer
---@param enabled boolean
function M.set_enabled(bufnr, enabled)
  vim.lsp.inline_completion.enable(enabled, { bufnr = bufnr })
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
      local item = normalize(bufnr, raw)
      if text.apply(bufnr, item, kind) and item.command then
        local client = vim.lsp.get_client_by_id(item.client_id)
        if client then
          util.exec_cmd(client, item.command, bufnr)
        end
      end
    end,
  })
end

---@param bufnr integer
---@param count integer
function M.select(bufnr, count)
  vim.lsp.inline_completion.select({ bufnr = bufnr, count = count })
end

---@param bufnr integer
---@return boolean
function M.dismiss(bufnr)
  -- Taking the item with a handler that inserts nothing is the public way to hide it.
  return vim.lsp.inline_completion.get({ bufnr = bufnr, on_accept = function() end })
end

return M
