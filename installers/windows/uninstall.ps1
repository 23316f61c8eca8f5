<#
.SYNOPSIS
    Remove MoE Desk as install.ps1 installed it: the shortcuts and the program folder (its private Python).

.DESCRIPTION
    Kept: the user's data, namely chats (%APPDATA%\MoE Desk), downloaded models (%LOCALAPPDATA%\MoE Desk\models),
    settings (registry, HKCU\Software\MoE Desk) and the Hugging Face cache. Delete those by hand to remove them too.
    setup.exe's uninstaller (Settings > Apps) runs this script with -KeepSetupFiles and then removes its own files.

.EXAMPLE
    powershell -NoProfile -ExecutionPolicy Bypass -File "$env:LOCALAPPDATA\Programs\MoE Desk\uninstall.ps1"
#>
[CmdletBinding()]
param(
    [string]$InstallDir = (Join-Path $env:LOCALAPPDATA 'Programs\MoE Desk'),
    # leave the files that setup.exe installed (its uninstaller removes them itself)
    [switch]$KeepSetupFiles
)

$ErrorActionPreference = 'Stop'
Set-StrictMode -Version 3

$AppName = 'MoE Desk'
$Marker = '.moedesk-install'

function Remove-IfThere([string]$Path) {
    if (Test-Path -LiteralPath $Path) {
        Remove-Item -LiteralPath $Path -Recurse -Force
        Write-Host "removed $Path"
    }
}

if (-not (Test-Path -LiteralPath $InstallDir)) {
    Write-Host "$AppName is not installed in $InstallDir"
    exit 0
}
if (-not (Test-Path -LiteralPath (Join-Path $InstallDir $Marker))) {
    throw "not removing ${InstallDir}: it was not made by MoE Desk's installer"
}

# the shortcuts install.ps1 listed, then the usual ones
$links = @()
$list = Join-Path $InstallDir 'installed-files.txt'
if (Test-Path -LiteralPath $list) { $links += @(Get-Content -LiteralPath $list | Where-Object { $_ }) }
$links += Join-Path ([Environment]::GetFolderPath('Programs')) "$AppName.lnk"
$links += Join-Path ([Environment]::GetFolderPath('Desktop')) "$AppName.lnk"
foreach ($link in ($links | Select-Object -Unique)) {
    if ($link -like '*.lnk' -and (Split-Path -Leaf $link) -like "$AppName*") { Remove-IfThere $link }
}

if ($KeepSetupFiles) {
    # what install.ps1 made; setup.exe's own files (src, vendor, the scripts, unins000.*) are its uninstaller's
    foreach ($item in @('venv', 'python', 'moedesk.ico', 'installed-files.txt', 'install.log', $Marker)) {
        Remove-IfThere (Join-Path $InstallDir $item)
    }
} else {
    # this script may live in the folder it removes: PowerShell has read it whole already
    Remove-IfThere $InstallDir
}
Write-Host "$AppName is uninstalled. Your chats, models and settings are kept."
